"""The C++ CPU decode kernel over an FP8 cache (kernels/src/pagedserve/kernels/cpu/paged_attention.cpp).

The kernel widens FP8 codes through a 256-entry table per format and folds k_scale into the
query scale and v_scale into the output, as the Triton kernel does. It is compared with the
float64 reference on the same dequantized cache and with the torch path (gathers + SDPA)
on the same FP8 cache: both read identical values and accumulate in fp32, so FP32_ATOL.
As in test_cpu_kernels.py, the extension must build here (no skip).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_paged_attention import FP32_ATOL, MIXED_QUERY_LENS, MIXED_SEQ_LENS, Batch, make_batch

from pagedserve.benchmarks.tiny_models import exactness_workload as workload
from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.kernels import paged_attention
from pagedserve.kernels.backend import AttentionImpl, resolve_backend
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.fp8 import dequantize_fp8, quantize_fp8
from pagedserve.kernels.reference import dense_causal_attention_reference
from tests.dataplane.test_engine_exactness import assert_no_leaks

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Per-tensor scales as calibration picks them: randn * 30 garbage saturates, real values
# (|x| < ~5) land well inside both formats' ranges.
K_SCALE, V_SCALE = 0.02, 0.005
DECODE_SEQ_LENS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129, 250, 301]


def fp8_batch(batch: Batch, fp8: torch.dtype) -> Batch:
    """The batch with its whole caches quantized (stale slots saturate or stay NaN)."""
    batch.key_cache = quantize_fp8(batch.key_cache, K_SCALE, fp8)
    batch.value_cache = quantize_fp8(batch.value_cache, V_SCALE, fp8)
    return batch


def reference(batch: Batch) -> torch.Tensor:
    """float64 attention over the cache's dequantized values."""
    return dense_causal_attention_reference(
        batch.query,
        dequantize_fp8(batch.key_cache, K_SCALE),
        dequantize_fp8(batch.value_cache, V_SCALE),
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )


def attend(batch: Batch, impl: AttentionImpl | None, query: torch.Tensor | None = None) -> torch.Tensor:
    return paged_attention(
        batch.query if query is None else query,
        batch.key_cache,
        batch.value_cache,
        batch.meta,
        batch.scale,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
        impl=impl,
    )


def run_kernel(ext: CpuKernels, batch: Batch) -> torch.Tensor:
    """The raw op: scale includes k_scale, v_scale scales the output."""
    out = torch.full_like(batch.query, 12345.0)
    meta = batch.meta
    ext.paged_decode_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        meta.decode_token_rows,
        batch.scale * K_SCALE,
        V_SCALE,
    )
    return out


@pytest.mark.parametrize("fp8", FP8)
def test_widening_is_exact_for_every_code(ext: CpuKernels, fp8: torch.dtype) -> None:
    # One context token: its softmax weight is exactly 1, so the output is V's widened codes
    # times v_scale, bit for bit (NaN codes give NaN; e5m2's infinities give inf). 259 values:
    # every code through the vector conversion, and a 3-code tail through the table.
    d = 259
    codes = (torch.arange(d) % 256).to(torch.uint8).view(fp8).view(1, 1, 1, d)
    key_cache = torch.zeros(1, 1, 1, d, dtype=fp8)
    query = torch.randn(1, 1, d)
    out = torch.empty_like(query)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens, rows = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    for v_scale in (1.0, 0.375):
        ext.paged_decode_attention(out, query, key_cache, codes, tables, lens, rows, 0.1, v_scale)
        expected = codes.view(-1).to(torch.float32) * v_scale
        assert torch.equal(out.view(-1).isnan(), expected.isnan())
        assert torch.equal(out.view(-1).nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the generic (runtime head_dim) path
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_decode_matches_reference(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int, head_dim: int, fp8: torch.dtype
) -> None:
    batch = fp8_batch(
        make_batch(
            [1] * len(DECODE_SEQ_LENS),
            DECODE_SEQ_LENS,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=head_dim,
            seed=block_size + head_dim,
            nonfinite_garbage=True,
        ),
        fp8,
    )
    out = run_kernel(ext, batch)
    assert torch.isfinite(out).all()
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL
    # The same FP8 cache through the torch path (which the engine used before).
    torch_out = attend(batch, "torch")
    assert (out - torch_out).abs().max().item() < FP32_ATOL


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 8)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_through_paged_attention(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int, fp8: torch.dtype
) -> None:
    batch = fp8_batch(
        make_batch(
            MIXED_QUERY_LENS,
            MIXED_SEQ_LENS,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=64,
            nonfinite_garbage=True,
        ),
        fp8,
    )
    out = attend(batch, "cpp")
    assert "decode" not in batch.meta._groups  # the decodes took the kernel
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL
    assert (out - attend(batch, "torch")).abs().max().item() < FP32_ATOL


@pytest.mark.parametrize("fp8", FP8)
def test_hook_layout_query(ext: CpuKernels, fp8: torch.dtype) -> None:
    # query[0].transpose(0, 1) of [1, H, T, D]: token stride D, head stride T * D.
    batch = fp8_batch(
        make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=3, group=3, head_dim=64),
        fp8,
    )
    strided = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = attend(batch, "cpp", strided)
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_long_contexts_and_sorted_batch(ext: CpuKernels) -> None:
    rng = random.Random(5)
    seq_lens = [3001, 1, 1500] + [rng.randint(1, 400) for _ in range(20)]
    batch = fp8_batch(
        make_batch(
            [1] * len(seq_lens), seq_lens, block_size=16, num_kv_heads=2, group=4, head_dim=128, seed=5
        ),
        torch.float8_e4m3fn,
    )
    assert (run_kernel(ext, batch).double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_by_device_uses_the_kernel_for_fp8_on_the_cpu(ext: CpuKernels) -> None:
    cpu = torch.device("cpu")
    for fp8 in FP8:
        assert resolve_backend(None, cpu, torch.float32, fp8).attention == "cpp"
        assert resolve_backend("torch", cpu, torch.float32, fp8).attention == "cpp"
        # The kernel computes in fp32 only: a bf16 model over an FP8 cache stays on torch.
        assert resolve_backend(None, cpu, torch.bfloat16, fp8).attention == "torch"
    batch = fp8_batch(
        make_batch([1, 1], [20, 33], block_size=16, num_kv_heads=1, group=2, head_dim=64), torch.float8_e5m2
    )
    attend(batch, None)
    assert "decode" not in batch.meta._groups


def test_kernel_checks_fp8_arguments(ext: CpuKernels) -> None:
    batch = fp8_batch(make_batch([1], [5], block_size=4, num_kv_heads=1, group=1, head_dim=64), FP8[0])
    meta = batch.meta
    out = torch.empty_like(batch.query)
    args = (meta.decode_block_tables, meta.decode_seq_lens, meta.decode_token_rows)
    with pytest.raises(RuntimeError, match="value_cache dtype"):
        ext.paged_decode_attention(
            out, batch.query, batch.key_cache, batch.value_cache.view(FP8[1]), *args, 1.0, 1.0
        )
    fp32 = batch.key_cache.float()
    with pytest.raises(RuntimeError, match=r"v_scale must be 1\.0"):
        ext.paged_decode_attention(out, batch.query, fp32, fp32, *args, 1.0, 0.5)
    with pytest.raises(
        RuntimeError, match="supports a float32, bfloat16, float8_e4m3fn or float8_e5m2 cache"
    ):
        ext.paged_decode_attention(
            out,
            batch.query,
            batch.key_cache.view(torch.uint8),
            batch.value_cache.view(torch.uint8),
            *args,
            1.0,
        )
    bf16 = batch.query.bfloat16()
    with pytest.raises(ValueError, match="float32 CPU query"):
        paged_attention(bf16, batch.key_cache, batch.value_cache, meta, 1.0, impl="cpp")


# The engine: an FP8 cache on the CPU now resolves to the C++ kernel, and its greedy tokens
# equal the torch FP8 path's (the path it took before).
@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def generate_greedy(path: Path, kv_cache_dtype: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), max_model_len=256, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=2**20)
    items = workload()[:6]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in items]
    outs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    assert_no_leaks(llm)
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_fp8_uses_the_kernel_and_matches_the_torch_path(
    ext: CpuKernels, tiny_qwen3: Path, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, tokens = generate_greedy(tiny_qwen3, kv_cache_dtype)
    assert llm.engine.runner.backends.attention == "cpp"
    assert llm.engine.runner.kv_caches[0][0].element_size() == 1
    scales: Any = llm.engine.kv_scales
    assert scales is not None and all(s != 1.0 for s in scales.k_scale + scales.v_scale)
    # The previous FP8 path: the torch backend without the C++ kernel.
    import pagedserve.kernels.backend

    monkeypatch.setattr(pagedserve.kernels.backend, "load_cpu_kernels", lambda: None)
    llm_torch, tokens_torch = generate_greedy(tiny_qwen3, kv_cache_dtype)
    assert llm_torch.engine.runner.backends.attention == "torch"
    assert tokens == tokens_torch
