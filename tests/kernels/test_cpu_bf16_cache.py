"""The C++ CPU kernels over a bf16 KV cache of an fp32 model (`--kv-cache-dtype bfloat16`).

Widening bf16 to fp32 is exact (a shift), and the kernels then run their fp32 code on the
widened rows: over a bf16 cache they must give *bit-identical* results to the same kernel
over an fp32 cache holding the same (bf16-rounded) values, for decode and prefill. The C++
write must store exactly torch's fp32 -> bf16 cast (round to nearest even). The torch path
(gathers + SDPA, widening the gathered blocks) agrees to FP32_ATOL. As in
test_cpu_kernels.py, the extension must build here (no skip).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_fp8 import DECODE_SEQ_LENS, generate_greedy
from test_paged_attention import FP32_ATOL, MIXED_QUERY_LENS, MIXED_SEQ_LENS, Batch, make_batch

from pagedserve.kernels import paged_attention, write_kv_cache
from pagedserve.kernels.backend import AttentionImpl, resolve_backend
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.fp8 import kv_cache_torch_dtype


def split(batch: Batch) -> tuple[Batch, Batch]:
    """(the batch over a bf16 cache, the same batch over an fp32 cache of the bf16 values)."""
    bf16_k, bf16_v = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
    wide = Batch(**{**batch.__dict__, "key_cache": bf16_k.float(), "value_cache": bf16_v.float()})
    narrow = Batch(**{**batch.__dict__, "key_cache": bf16_k, "value_cache": bf16_v})
    return narrow, wide


def attend(batch: Batch, impl: AttentionImpl) -> torch.Tensor:
    return paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl=impl
    )


def run_kernels(ext: CpuKernels, batch: Batch) -> torch.Tensor:
    """This ISA build's decode and prefill ops over the batch, as pagedserve.kernels.attention calls them."""
    out = torch.full_like(batch.query, 12345.0)
    meta = batch.meta
    caches = (batch.query, batch.key_cache, batch.value_cache)
    if meta.num_decode_tokens:
        ext.paged_decode_attention(
            out,
            *caches,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.decode_token_rows,
            batch.scale,
            1.0,
        )
    if meta.prefills:
        ext.paged_prefill_attention(
            out,
            *caches,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_starts,
            meta.prefill_query_lens,
            batch.scale,
        )
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the generic (runtime head_dim) path
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_decode_is_bit_identical_to_the_fp32_kernel_on_the_same_values(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int, head_dim: int
) -> None:
    batch = make_batch(
        [1] * len(DECODE_SEQ_LENS),
        DECODE_SEQ_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        seed=block_size + head_dim,
        nonfinite_garbage=True,
    )
    narrow, wide = split(batch)
    out = run_kernels(ext, narrow)
    assert torch.isfinite(out).all()
    assert torch.equal(out, run_kernels(ext, wide))
    assert (out - attend(narrow, "torch")).abs().max().item() < FP32_ATOL


@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 8)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_prefill_and_mixed_batches_are_bit_identical_too(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int, head_dim: int
) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        nonfinite_garbage=True,
    )
    narrow, wide = split(batch)
    out = run_kernels(ext, narrow)
    assert torch.isfinite(out).all()
    assert torch.equal(out, run_kernels(ext, wide))
    # The engine's path (impl "cpp": the native build) and the torch path over the bf16 cache.
    assert torch.equal(attend(narrow, "cpp"), attend(wide, "cpp"))
    assert (out - attend(narrow, "torch")).abs().max().item() < FP32_ATOL


def test_the_cpp_write_rounds_exactly_as_torch_casts(ext: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, dim = 6, 4, 3, 40
    # Values on every rounding case: ties to even (x.5 ulp of bf16), near-overflow, tiny,
    # negative zero, infinities.
    key = torch.randn(9, kv_heads, dim, generator=gen) * 10.0
    key.view(-1)[:6] = torch.tensor([1.00390625, 1.01171875, 3.3895e38, 1e-40, -0.0, float("inf")])
    # A strided view, as the fused layers pass (K and V are slices of the q/k/v output).
    qkv = torch.randn(9, 3 * kv_heads, dim, generator=gen)
    qkv[:, :kv_heads] = key
    key, value = qkv[:, :kv_heads], qkv[:, kv_heads : 2 * kv_heads]
    slots = torch.tensor([0, 5, 6, 7, 11, 12, 19, 22, 23])
    caches = {}
    for impl in ("ext", "cpp", "torch"):
        k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        if impl == "ext":  # this ISA build's op
            ext.write_kv_cache(k_cache, v_cache, key, value, slots)
        else:
            write_kv_cache(key, value, k_cache, v_cache, slots, impl=impl)  # type: ignore[arg-type]
        caches[impl] = (k_cache, v_cache)
    for c, n, t, src in zip(caches["ext"], caches["cpp"], caches["torch"], (key, value), strict=True):
        assert torch.equal(c.view(torch.int16), t.view(torch.int16))
        assert torch.equal(n.view(torch.int16), t.view(torch.int16))
        assert torch.equal(
            c.view(-1, kv_heads, dim)[slots].view(torch.int16), src.bfloat16().view(torch.int16)
        )
    # Untouched slots stay zero.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not caches["ext"][0].view(-1, kv_heads, dim)[untouched].any()


def test_a_bf16_cache_resolves_to_the_kernels_and_its_limits(ext: CpuKernels) -> None:
    cpu = torch.device("cpu")
    backends = resolve_backend(None, cpu, torch.float32, torch.bfloat16)
    assert (backends.attention, backends.cache_write) == ("cpp", "cpp")
    assert kv_cache_torch_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_torch_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="float32 or bfloat16 model"):
        kv_cache_torch_dtype("bfloat16", torch.float16)
    # An fp16 query over a bf16 cache is a configuration error, not a silent cast.
    batch = make_batch([1], [5], block_size=4, num_kv_heads=1, group=1, head_dim=64)
    narrow, _ = split(batch)
    with pytest.raises(ValueError, match=r"query dtype torch\.float16 != cache dtype torch\.bfloat16"):
        paged_attention(narrow.query.half(), narrow.key_cache, narrow.value_cache, narrow.meta, 1.0)


# The engine: `kv_cache_dtype="bfloat16"` halves the pool's bytes per block, runs the C++
# kernels, returns every block, and its greedy tokens equal those of the torch path over the
# same bf16 cache.
def test_engine_bf16_cache(ext: CpuKernels, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fp32_llm, _ = generate_greedy(tiny, "auto")
    llm, tokens = generate_greedy(tiny, "bfloat16")
    runner = llm.engine.runner
    assert runner.backends.attention == "cpp" and runner.backends.cache_write == "cpp"
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert llm.engine.kv_scales is None
    # The same kv_cache_memory holds twice the blocks of the fp32 pool.
    assert llm.engine.budget.num_blocks == 2 * fp32_llm.engine.budget.num_blocks
    import pagedserve.kernels.backend

    monkeypatch.setattr(pagedserve.kernels.backend, "load_cpu_kernels", lambda: None)
    llm_torch, tokens_torch = generate_greedy(tiny, "bfloat16")
    assert llm_torch.engine.runner.backends.attention == "torch"
    assert tokens == tokens_torch
