"""Every Triton kernel against its torch reference, on the GPU or (here) in Triton's interpreter.

Tolerances. The cache kernels move or quantize values, so they must match the torch
reference bit for bit (FP8 quantization included: both multiply by the same fp32 reciprocal
scale and round to nearest even, see pagedserve.kernels.fp8). Attention is compared with the float64
dense reference (pagedserve.kernels.reference) and with the torch path at the dtype tolerances of
test_paged_attention (fp32 1e-5; fp16 4e-3; bf16 3e-2: both implementations keep fp32
softmax statistics and accumulators and differ only in where they round to the query dtype).
An FP8 cache adds no tolerance: FP8 values widen exactly to fp32/fp16/bf16 and both sides
read the same quantized cache; the references see its dequantized values.

Interpreter workarounds (triton 3.9; kernels/src/pagedserve/kernels/triton_ops/jit.py): bf16 dot operands are
widened to fp32 after rounding to bf16, and fp32 -> bf16 output casts round explicitly, so
the interpreter computes what the GPU does; FP8 quantization never relies on Triton's cast
rounding. test_interpreter_bug_workarounds_are_needed shows the bugs are real, so the
workarounds stay justified.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_paged_attention import (
    BF16_ATOL,
    FP16_ATOL,
    FP32_ATOL,
    MIXED_QUERY_LENS,
    MIXED_SEQ_LENS,
    Batch,
    make_batch,
)

from pagedserve.kernels import (
    build_attention_metadata,
    copy_blocks,
    paged_attention,
    swap_blocks,
    write_kv_cache,
)
from pagedserve.kernels.fp8 import dequantize_fp8, quantize_fp8
from pagedserve.kernels.reference import dense_causal_attention_reference
from pagedserve.kernels.triton_ops.attention import TileConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: FP32_ATOL, torch.float16: FP16_ATOL, torch.bfloat16: BF16_ATOL}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SMALL_TILES = TileConfig(block_m=16, tile_n=16)
gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)"
)


def fp8_batch(batch: Batch, fp8: torch.dtype, k_scale: float, v_scale: float) -> Batch:
    """The batch with its caches quantized to fp8 (whole caches: stale slots saturate)."""
    batch.key_cache = quantize_fp8(batch.key_cache, k_scale, fp8)
    batch.value_cache = quantize_fp8(batch.value_cache, v_scale, fp8)
    return batch


def reference(batch: Batch, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    kc, vc = batch.key_cache.cpu(), batch.value_cache.cpu()
    if kc.dtype in FP8:
        kc, vc = dequantize_fp8(kc, k_scale), dequantize_fp8(vc, v_scale)
    return dense_causal_attention_reference(
        batch.query.cpu(), kc, vc, batch.query_lens, batch.seq_lens, batch.block_tables, batch.scale
    )


def check_attention(
    batch: Batch, atol: float, k_scale: float = 1.0, v_scale: float = 1.0, **triton_kwargs: object
) -> None:
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    if triton_kwargs:
        from pagedserve.kernels.triton_ops import paged_attention_triton

        out = paged_attention_triton(*args, k_scale, v_scale, **triton_kwargs)  # type: ignore[arg-type]
    else:
        out = paged_attention(*args, k_scale=k_scale, v_scale=v_scale, impl="triton")
    torch_out = paged_attention(*args, k_scale=k_scale, v_scale=v_scale, impl="torch")
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype and out.is_contiguous()
    ref = reference(batch, k_scale, v_scale)
    assert (out.cpu().double() - ref).abs().max().item() < atol
    assert (torch_out.cpu().double() - ref).abs().max().item() < atol
    assert (out.double() - torch_out.double()).abs().max().item() < atol


# ---- paged attention --------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_attention_fp32_block_sizes_and_gqa(block_size: int, num_kv_heads: int, group: int) -> None:
    # Decodes with ragged contexts and partial last blocks, a fresh prompt, chunked prefills.
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        device=DEVICE,
    )
    # 16-key tiles: within a block (32), one block (16) or 16 blocks (1) per tile.
    check_attention(batch, FP32_ATOL, tiles=SMALL_TILES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(3, 3), (1, 8)])
def test_attention_head_dim_128_and_half_dtypes(dtype: torch.dtype, num_kv_heads: int, group: int) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=16,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=128 if dtype == torch.float32 else 64,
        dtype=dtype,
        device=DEVICE,
        seed=1,
    )
    check_attention(batch, ATOL[dtype])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_fp8_cache(fp8: torch.dtype, dtype: torch.dtype) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
        device=DEVICE,
        seed=2,
    )
    # Scales far from 1 so a missing or doubled scale shows.
    check_attention(fp8_batch(batch, fp8, 0.02, 0.005), ATOL[dtype], 0.02, 0.005)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_kv_decode(num_splits: int) -> None:
    # Long decodes (one shorter than a split: its later splits are empty) plus a prefill chunk.
    batch = make_batch(
        [1, 1, 1, 6], [300, 97, 17, 60], block_size=16, num_kv_heads=2, group=4, head_dim=64, device=DEVICE
    )
    check_attention(batch, FP32_ATOL, num_splits=num_splits, tiles=SMALL_TILES)


def test_split_kv_decode_fp8_bf16() -> None:
    batch = make_batch(
        [1, 1],
        [200, 33],
        block_size=32,
        num_kv_heads=1,
        group=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    check_attention(fp8_batch(batch, torch.float8_e4m3fn, 0.01, 0.01), BF16_ATOL, 0.01, 0.01, num_splits=4)


def test_tiles_wider_than_blocks_and_odd_head_dim() -> None:
    # 32-key tiles over 16-token blocks; head_dim 24 pads to 32 inside the kernel.
    batch = make_batch(
        [1, 9, 1], [70, 40, 5], block_size=16, num_kv_heads=2, group=2, head_dim=24, device=DEVICE
    )
    check_attention(batch, FP32_ATOL, tiles=TileConfig(block_m=32, tile_n=32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_nonfinite_slots_never_read(dtype: torch.dtype) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
        nonfinite_garbage=True,
        device=DEVICE,
    )
    check_attention(batch, ATOL[dtype])


def test_random_ragged_batches() -> None:
    rng = random.Random(7)
    for seed in range(4):
        n = rng.randint(1, 5)
        query_lens = [rng.choice([1, 1, rng.randint(2, 20)]) for _ in range(n)]
        seq_lens = [q + rng.randint(0, 60) for q in query_lens]
        batch = make_batch(
            query_lens,
            seq_lens,
            block_size=rng.choice([1, 4, 16, 32]),
            num_kv_heads=rng.choice([1, 2]),
            group=rng.choice([1, 3, 8]),
            head_dim=rng.choice([16, 64]),
            seed=seed,
            device=DEVICE,
        )
        check_attention(batch, FP32_ATOL)


def test_strided_query_and_empty_batch() -> None:
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=3, group=3, head_dim=64, device=DEVICE
    )
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not batch.query.is_contiguous()
    check_attention(batch, FP32_ATOL)
    meta = build_attention_metadata([], [], [], 16, DEVICE)
    cache = torch.zeros(4, 16, 2, 8, device=DEVICE)
    out = paged_attention(torch.zeros(0, 4, 8, device=DEVICE), cache, cache, meta, 1.0, impl="triton")
    assert out.shape == (0, 4, 8)


def test_num_splits_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.kernels.triton_ops import attention as tri

    monkeypatch.setattr(tri, "_num_sms", lambda _index: 132)
    cuda = torch.device("cuda", 0)
    assert tri.choose_num_splits(5, 3, 4096, torch.device("cpu")) == 1
    assert tri.choose_num_splits(32, 8, 4096, cuda) == 1  # 256 programs fill 132 SMs
    assert tri.choose_num_splits(32, 3, 4096, cuda) == 2  # 96 programs: ~2 waves need 3 -> 2
    assert tri.choose_num_splits(1, 1, 4096, cuda) == 16  # capped by 4096 / 256 keys per split
    assert tri.choose_num_splits(1, 1, 300, cuda) == 1
    assert tri.choose_num_splits(1, 1, 100_000, cuda) == tri.MAX_SPLITS


def test_e4m3_needs_sm89_in_compiled_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.kernels import backend

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (8, 0))
    assert backend.default_backend(cuda, torch.float8_e4m3fn) == "torch"  # A100: torch path
    assert backend.default_backend(cuda, torch.float8_e5m2) == "triton"
    assert backend.default_backend(cuda, torch.bfloat16) == "triton"
    by_device = backend.resolve_backend(None, cuda, torch.bfloat16, torch.float8_e4m3fn)
    assert by_device == backend.ResolvedBackends(attention="torch", cache="torch", cache_write="torch")
    with pytest.raises(ValueError, match="sm_89"):
        backend.cache_impl_for("triton", cuda, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="sm_89"):  # the engine's choice, refused at start-up
        backend.resolve_backend("triton", cuda, torch.bfloat16, torch.float8_e4m3fn)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (9, 0))
    assert backend.default_backend(cuda, torch.float8_e4m3fn) == "triton"


def test_triton_launcher_validation() -> None:
    from pagedserve.kernels.triton_ops import paged_attention_triton

    batch = make_batch([1], [5], block_size=4, num_kv_heads=1, group=1, head_dim=16, device=DEVICE)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(*args, num_splits=3)
    with pytest.raises(ValueError, match="FP8 caches only"):
        paged_attention_triton(*args, k_scale=0.5)
    fp8 = fp8_batch(batch, torch.float8_e4m3fn, 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        paged_attention_triton(fp8.query, fp8.key_cache, fp8.value_cache, fp8.meta, 1.0, 0.0, 1.0)


# ---- cache write ----------------------------------------------------------------------


def _write_both(
    key: torch.Tensor,
    value: torch.Tensor,
    cache_dtype: torch.dtype,
    slots: torch.Tensor,
    scales: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (6, 16, key.shape[1], key.shape[2])
    out = []
    for impl in ("torch", "triton"):
        kc = torch.full(shape, -3.0, device=DEVICE).to(cache_dtype)
        vc = torch.full(shape, -5.0, device=DEVICE).to(cache_dtype)
        write_kv_cache(key, value, kc, vc, slots, *scales, impl=impl)
        out.append(torch.stack([kc, vc]))
    return out[0], out[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_same_dtype_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # Strided like the attention hook's key[0].transpose(0, 1).
    key = torch.randn(3, 40, 64, generator=gen).to(dtype).transpose(0, 1).to(DEVICE)
    value = torch.randn(3, 40, 64, generator=gen).to(dtype).transpose(0, 1).to(DEVICE)
    slots = torch.randperm(96, generator=gen)[:40].to(DEVICE)
    ref, tri = _write_both(key, value, dtype, slots, (1.0, 1.0))
    assert torch.equal(ref, tri)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_fp8_bit_exact(fp8: torch.dtype, src_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # Magnitudes from 1e-7 to 1e5 after scaling: subnormals, normals, saturation; +-0.
    mags = torch.logspace(-7, 5, 48)[:, None, None]
    key = (torch.randn(48, 2, 32, generator=gen) * mags * 0.37).to(src_dtype)
    value = (torch.randn(48, 2, 32, generator=gen) * mags * 0.011).to(src_dtype)
    key[0, 0, :2] = torch.tensor([0.0, -0.0])
    slots = torch.randperm(96, generator=gen)[:48]
    ref, tri = _write_both(key.to(DEVICE), value.to(DEVICE), fp8, slots.to(DEVICE), (0.37, 0.011))
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_quantization_rounds_to_nearest_even_and_saturates(fp8: torch.dtype) -> None:
    # Every finite FP8 value, the midpoints between neighbours (ties) and points just off them.
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    grid = values[values.isfinite()].unique()  # sorted, -max .. max
    mids = (grid[1:] + grid[:-1]) / 2
    eps = (grid[1:] - grid[:-1]) / 16
    limit = float(grid.max())
    x = torch.cat([grid, mids, mids + eps, mids - eps, torch.tensor([limit * 1.01, 2 * limit, 1e30, -1e30])])
    # Few tokens of many elements: the write kernel runs one program per token.
    x = torch.cat([x, torch.zeros(-x.numel() % 256)]).view(-1, 8, 32)
    ref = quantize_fp8(x, 1.0, fp8).float().flatten()
    # The reference: ties go to the even neighbour (low mantissa bit 0), beyond max saturates.
    flat = x.flatten()
    tie = torch.isin(flat, mids)
    assert (ref[tie].to(fp8).view(torch.uint8) & 1 == 0).all()
    assert (ref[flat.abs() > limit].abs() == limit).all()
    assert torch.equal(ref[: grid.numel()], grid)
    slots = torch.arange(x.shape[0])
    shape = (x.shape[0], 1, 8, 32)
    kc, vc = torch.zeros(shape, dtype=fp8, device=DEVICE), torch.zeros(shape, dtype=fp8, device=DEVICE)
    write_kv_cache(x.to(DEVICE), x.to(DEVICE), kc, vc, slots.to(DEVICE), 1.0, 1.0, impl="triton")
    assert torch.equal(kc.cpu().float().flatten(), ref)


# ---- block copy and swap ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_copy_blocks_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(7, 4, 2, 8, generator=gen).to(dtype).to(DEVICE) for _ in range(4)]
    # Block 1 is both a destination and a source (sources are read first); block 0 too.
    pairs = [(1, 3), (0, 1), (5, 0), (6, 2)]
    results = []
    for impl in ("torch", "triton"):
        cs = [c.clone() for c in caches]
        copy_blocks(cs[:2], cs[2:], pairs, impl=impl)
        results.append(torch.stack(cs).view(torch.uint8) if dtype.itemsize == 1 else torch.stack(cs))
    assert torch.equal(results[0], results[1])
    for c_after, c_before in zip(results[0], caches, strict=True):
        before = c_before.view(torch.uint8) if dtype.itemsize == 1 else c_before
        assert torch.equal(c_after[3], before[1]) and torch.equal(c_after[1], before[0])


def test_swap_blocks_matches_torch() -> None:
    gen = torch.Generator().manual_seed(4)
    device_pool = [torch.randn(6, 4, 2, 8, generator=gen).to(DEVICE) for _ in range(2)]
    host_pool = [torch.randn(9, 4, 2, 8, generator=gen) for _ in range(2)]
    out_pairs, in_pairs = [(5, 0), (2, 8), (0, 3)], [(0, 1), (8, 4)]
    results = []
    for impl in ("torch", "triton"):
        dev, host = [c.clone() for c in device_pool], [c.clone() for c in host_pool]
        swap_blocks(dev, host, out_pairs, impl=impl)
        swap_blocks(host, dev, in_pairs, impl=impl)
        results.append((dev, host))
        for layer in range(2):
            assert torch.equal(host[layer][0], device_pool[layer][5])
            assert torch.equal(host[layer][8], device_pool[layer][2])
            assert torch.equal(dev[layer][1], device_pool[layer][5])  # out to host 0, back in to 1
            assert torch.equal(dev[layer][4], device_pool[layer][2])
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(a, b)


def test_swap_blocks_validation() -> None:
    with pytest.raises(ValueError, match="block shape and dtype"):
        swap_blocks([torch.zeros(4, 4, 2, 8)], [torch.zeros(4, 4, 2, 4)], [(0, 0)])
    with pytest.raises(ValueError, match="destination block ids"):
        swap_blocks([torch.zeros(4, 4, 2, 8)], [torch.zeros(2, 4, 2, 8)], [(0, 2)])


# ---- compiled for real GPUs, without one -----------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above run the compiled kernels")
def test_kernels_compile_for_gpu_targets() -> None:
    # What the interpreter cannot check: Triton's compiler accepts every launch
    # configuration, for Hopper and for Ampere (e5m2; e4m3 needs sm_89+ and is refused).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = Path(__file__).with_name("compile_kernels.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("compiled:") == 8


# ---- the interpreter's bugs are real (so the workarounds are needed) -------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks Triton's CPU interpreter")
def test_interpreter_bug_workarounds_are_needed() -> None:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]  # (pointers and constexprs, as in triton_ops/jit.py)
    def cast_kernel(src, dst, N: tl.constexpr):  # type: ignore[no-untyped-def]
        o = tl.arange(0, N)
        tl.store(dst + o, tl.load(src + o).to(dst.dtype.element_ty))

    x = torch.tensor([1.0 + 2**-8 + 2**-10, 1000.0, 1.0 + 3 * 2**-4, 0.0])
    bf16 = torch.empty(4, dtype=torch.bfloat16)
    cast_kernel[(1,)](x, bf16, 4)
    assert bf16[0] != x[0].to(torch.bfloat16)  # truncated instead of rounded
    e4m3 = torch.empty(4, dtype=torch.float8_e4m3fn)
    cast_kernel[(1,)](x, e4m3, 4)
    expected = quantize_fp8(x, 1.0, torch.float8_e4m3fn)
    assert not torch.equal(e4m3.view(torch.uint8), expected.view(torch.uint8))  # no saturation / carry


# ---- GPU only: compiled kernels at serving shapes ---------------------------------------


@gpu_only
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_long_context_decode_and_by_device_backend(kv_dtype: torch.dtype) -> None:
    # Llama-8B-like heads, 4k contexts (split-KV chosen automatically) next to a prefill chunk.
    batch = make_batch(
        [1, 1, 1, 1, 64],
        [4096, 4000, 1500, 77, 600],
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    scales = (1.0, 1.0)
    if kv_dtype != torch.bfloat16:
        scales = (0.02, 0.02)
        batch = fp8_batch(batch, kv_dtype, *scales)
    by_device = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.meta,
        batch.scale,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    triton_out = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.meta,
        batch.scale,
        k_scale=scales[0],
        v_scale=scales[1],
        impl="triton",
    )
    assert torch.equal(by_device, triton_out)  # impl=None is Triton on CUDA
    check_attention(batch, BF16_ATOL, *scales)
