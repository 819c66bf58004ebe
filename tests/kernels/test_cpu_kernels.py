"""The C++ CPU decode kernel (kernels/src/pagedserve/kernels/cpu/paged_attention.cpp) against the float64 reference.

The extension must build here: a build failure fails these tests (load_cpu_kernels(strict=True)
raises with the compiler's output) rather than skipping them. CI has a compiler and installs
ninja through the project's dependencies. The engine itself falls back to the torch path.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_paged_attention import FP32_ATOL, MIXED_QUERY_LENS, MIXED_SEQ_LENS, Batch, make_batch, max_error

from pagedserve.kernels import build_attention_metadata, paged_attention
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.reference import dense_causal_attention_reference


def reference(batch: Batch, query: torch.Tensor | None = None) -> torch.Tensor:
    return dense_causal_attention_reference(
        batch.query if query is None else query,
        batch.key_cache,
        batch.value_cache,
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )


def run_kernel(ext: CpuKernels, batch: Batch, out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw op on the metadata's decode tensors; rows it does not own are left as they were."""
    if out is None:
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
        batch.scale,
    )
    return out


# Ragged decode contexts: a single token, lengths around block and vector (16) boundaries,
# exact multiples of 16 and 32, partial last blocks, and a few longer ones.
DECODE_SEQ_LENS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129, 250, 301]


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the generic (runtime head_dim) path
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_decode_matches_reference(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int, head_dim: int
) -> None:
    # make_batch scatters blocks by a random permutation (never the identity) and fills every
    # unused slot with NaN/inf, so reading a wrong or stale slot poisons the output.
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
    out = run_kernel(ext, batch)
    assert torch.isfinite(out).all()
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_decode_sorted_longest_first_and_rows_mapped_back(ext: CpuKernels) -> None:
    rng = random.Random(7)
    seq_lens = [rng.randint(1, 400) for _ in range(37)]
    batch = make_batch([1] * 37, seq_lens, block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=7)
    lens = batch.meta.decode_seq_lens.tolist()
    assert lens == sorted(seq_lens, reverse=True)
    assert [seq_lens[r] for r in batch.meta.decode_token_rows.tolist()] == lens
    assert (run_kernel(ext, batch).double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_long_contexts(ext: CpuKernels) -> None:
    batch = make_batch(
        [1, 1, 1], [3001, 1, 1500], block_size=16, num_kv_heads=2, group=4, head_dim=128, seed=11
    )
    assert (run_kernel(ext, batch).double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_only_decode_rows_are_written(ext: CpuKernels) -> None:
    # Mixed batch: the kernel writes the decode rows and must leave the prefill rows alone.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=2, group=3, head_dim=64)
    out = run_kernel(ext, batch)
    decode_rows = set(batch.meta.decode_token_rows.tolist())
    ref = reference(batch)
    for row in range(batch.query.shape[0]):
        if row in decode_rows:
            assert (out[row].double() - ref[row]).abs().max().item() < FP32_ATOL
        else:
            assert (out[row] == 12345.0).all()


@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 8)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_through_paged_attention(
    ext: CpuKernels, num_kv_heads: int, group: int, block_size: int
) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        nonfinite_garbage=True,
    )
    assert max_error(batch, impl="cpp") < FP32_ATOL
    # The C++ decode path never builds the torch path's decode groups.
    assert "decode" not in batch.meta._groups


def test_by_device_uses_the_kernel_for_fp32_cpu(ext: CpuKernels) -> None:
    batch = make_batch([1, 1], [20, 33], block_size=16, num_kv_heads=1, group=2, head_dim=64)
    paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert "decode" not in batch.meta._groups
    paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="torch")
    assert "decode" in batch.meta._groups


def test_hook_layout_query(ext: CpuKernels) -> None:
    # query[0].transpose(0, 1) of [1, H, T, D]: token stride D, head stride T * D.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=3, group=3, head_dim=64)
    strided = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    out = paged_attention(strided, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp")
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL
    # A query whose head_dim is not contiguous is copied first.
    odd = batch.query.transpose(1, 2).contiguous().transpose(1, 2)
    assert odd.stride(2) != 1
    out = paged_attention(odd, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp")
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_result_does_not_depend_on_thread_count(ext: CpuKernels) -> None:
    # Each (sequence, kv head) item is computed whole by one thread, in a fixed order.
    rng = random.Random(3)
    seq_lens = [rng.randint(1, 300) for _ in range(24)]
    batch = make_batch([1] * 24, seq_lens, block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(ext, batch)
        torch.set_num_threads(max(2, threads))
        many = run_kernel(ext, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_inference_mode(ext: CpuKernels) -> None:
    batch = make_batch([1, 3], [40, 3], block_size=16, num_kv_heads=2, group=2, head_dim=64)
    with torch.inference_mode():
        out = paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp"
        )
    assert (out.double() - reference(batch)).abs().max().item() < FP32_ATOL


def test_impl_validation(ext: CpuKernels) -> None:
    batch = make_batch([1], [5], block_size=4, num_kv_heads=1, group=1, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 CPU query"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp")
    with pytest.raises(ValueError, match="impl must be"):
        paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.meta,
            batch.scale,
            impl="bogus",  # type: ignore[arg-type]
        )
    # by device (impl=None), bf16 quietly takes the torch path
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert out.dtype == torch.bfloat16


def test_kernel_rejects_bad_indices(ext: CpuKernels) -> None:
    meta = build_attention_metadata([1], [5], [[0, 1]], 4, "cpu")
    cache = torch.zeros(2, 4, 1, 64)
    query = torch.zeros(1, 1, 64)
    out = torch.empty_like(query)
    args = (cache, cache.clone())
    ext.paged_decode_attention(
        out, query, *args, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_token_rows, 1.0
    )
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        ext.paged_decode_attention(
            out,
            query,
            *args,
            torch.tensor([[0, 2]], dtype=torch.int32),
            meta.decode_seq_lens,
            meta.decode_token_rows,
            1.0,
        )
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_decode_attention(
            out,
            query,
            *args,
            meta.decode_block_tables,
            torch.tensor([9], dtype=torch.int32),
            meta.decode_token_rows,
            1.0,
        )
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_decode_attention(
            out, query, *args, meta.decode_block_tables, meta.decode_seq_lens, torch.tensor([1]), 1.0
        )
    with pytest.raises(RuntimeError, match="float32 only"):
        ext.paged_decode_attention(
            out.double(),
            query.double(),
            cache.double(),
            cache.double(),
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.decode_token_rows,
            1.0,
        )
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_decode_attention(
            out,
            query,
            *args,
            meta.decode_block_tables.long(),
            meta.decode_seq_lens,
            meta.decode_token_rows,
            1.0,
        )


def test_import_does_not_build() -> None:
    code = (
        "import pagedserve.kernels.cpu_ext as c, sys; "
        "assert not c._loaded; assert 'torch.utils.cpp_extension' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
