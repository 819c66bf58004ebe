"""The C++ CPU prefill kernel (kernels/src/pagedserve/kernels/cpu/prefill_attention.cpp) against the torch path.

The reference is paged_attention(impl="torch"): gathers + SDPA with the bottom-right causal
mask. As for the decode kernel, the extension must build here (no skip).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import MIXED_QUERY_LENS, MIXED_SEQ_LENS, Batch, make_batch

from pagedserve.kernels import paged_attention
from pagedserve.kernels.cpu_ext import CpuKernels

SENTINEL = 12345.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def torch_path(batch: Batch) -> torch.Tensor:
    return paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="torch"
    )


def run_prefill(ext: CpuKernels, batch: Batch) -> torch.Tensor:
    """The raw op on the metadata's prefill tensors; rows it does not own keep SENTINEL."""
    out = torch.full_like(batch.query, SENTINEL)
    meta = batch.meta
    ext.paged_prefill_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        meta.prefill_block_tables,
        meta.prefill_seq_lens,
        meta.prefill_query_starts,
        meta.prefill_query_lens,
        batch.scale,
    )
    return out


@pytest.fixture(autouse=True)
def _process_kernels_are_ext(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_attention(impl="cpp") takes the process's kernels: make them the ISA build the
    test's `ext` is, so the op and the dispatcher are compared within one build."""
    if "ext" in request.fixturenames:
        from pagedserve.kernels.cpu_isa import ISA_ENV

        monkeypatch.setenv(ISA_ENV, request.getfixturevalue("ext").isa)


def prefill_rows(batch: Batch) -> torch.Tensor:
    return torch.cat([torch.arange(p.token_start, p.token_end) for p in batch.meta.prefills])


def assert_matches_torch_path(ext: CpuKernels, batch: Batch) -> None:
    """The op writes exactly the prefill rows, equal to the torch path's; paged_attention
    with impl "cpp" gives the same rows bit for bit, and the torch path's decode rows."""
    rows = prefill_rows(batch)
    expected = torch_path(batch)
    out = run_prefill(ext, batch)
    assert_close(out[rows], expected[rows])
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == SENTINEL).all()
    via_cpp = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp"
    )
    assert torch.equal(via_cpp[rows], out[rows])
    assert_close(via_cpp, expected)


# (query_lens, seq_lens): fresh prompts of several lengths (2, around the 16-token tile and
# 32-key tile edges); chunks with a cached prefix (a prefix-cache hit or a later chunk);
# prefills mixed with decodes, including a 1-token prompt (a decode by query length).
SCENARIOS = {
    "fresh": ([2, 17, 33, 50], [2, 17, 33, 50]),
    "cached_prefix": ([5, 40, 17], [23, 90, 167]),
    "mixed": (MIXED_QUERY_LENS, MIXED_SEQ_LENS),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_torch_path(
    ext: CpuKernels, block_size: int, head_dim: int, num_kv_heads: int, group: int, scenario: str
) -> None:
    query_lens, seq_lens = SCENARIOS[scenario]
    # Every slot outside the contexts holds NaN/inf: a stale read poisons the output.
    batch = make_batch(
        query_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        seed=block_size * 100 + head_dim + group,
        nonfinite_garbage=True,
    )
    assert_matches_torch_path(ext, batch)


@pytest.mark.parametrize("cached", [0, 150])
def test_long_prompt(ext: CpuKernels, cached: int) -> None:
    batch = make_batch(
        [300, 3], [300 + cached, 3], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=cached
    )
    assert_matches_torch_path(ext, batch)


def test_one_token_prompt(ext: CpuKernels) -> None:
    # A 1-token prompt is a decode to the metadata; the op itself takes query_len 1 too.
    batch = make_batch([1, 1], [1, 9], block_size=4, num_kv_heads=1, group=2, head_dim=64, seed=5)
    out = torch.full_like(batch.query, SENTINEL)
    ext.paged_prefill_attention(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.meta.block_tables,
        batch.meta.seq_lens,
        batch.meta.query_start_loc[:-1].long(),
        torch.ones(2, dtype=torch.int32),
        batch.scale,
    )
    expected = torch_path(batch)
    assert_close(out, expected)
    # One key: the output is that key's value row, for both query heads.
    v0 = batch.value_cache[batch.block_tables[0][0], 0, 0]
    torch.testing.assert_close(out[0], torch.stack([v0, v0]), rtol=0, atol=0)


def test_metadata_prefill_tensors() -> None:
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=1, group=1, head_dim=8)
    meta = batch.meta
    # Prefills are sequences 1, 4 and 6 of MIXED (query lens 7, 5, 9), in batch order.
    assert meta.prefill_query_lens.tolist() == [7, 5, 9]
    assert meta.prefill_seq_lens.tolist() == [7, 23, 41]
    assert meta.prefill_query_starts.tolist() == [1, 10, 16]
    assert meta.prefill_query_lens.dtype == meta.prefill_seq_lens.dtype == torch.int32
    assert meta.prefill_query_starts.dtype == torch.int64
    tables = [batch.block_tables[s] for s in (1, 4, 6)]
    assert meta.prefill_block_tables.tolist() == [t + [0] * (3 - len(t)) for t in tables]
    assert meta.max_prefill_blocks == 3


def test_result_does_not_depend_on_thread_count(ext: CpuKernels) -> None:
    batch = make_batch(
        [290, 40, 7, 1], [290, 190, 7, 30], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=3
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_prefill(ext, batch)
        torch.set_num_threads(2)
        two = run_prefill(ext, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_paged_attention_skips_sdpa_for_fp32_prefills(
    ext: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_batch([9, 20], [9, 31], block_size=16, num_kv_heads=2, group=3, head_dim=64)
    expected = torch_path(batch)

    def no_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("SDPA called for an fp32 prefill under impl='cpp'")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp"
    )
    assert_close(out, expected)


def test_rejects_bad_inputs(ext: CpuKernels) -> None:
    batch = make_batch([5], [12], block_size=4, num_kv_heads=1, group=2, head_dim=64)
    meta = batch.meta
    tensors = [
        meta.prefill_block_tables,
        meta.prefill_seq_lens,
        meta.prefill_query_starts,
        meta.prefill_query_lens,
    ]
    out = torch.empty_like(batch.query)
    caches = [batch.key_cache, batch.value_cache]

    def call(
        o: torch.Tensor, q: torch.Tensor, kv: list[torch.Tensor], meta_tensors: list[torch.Tensor]
    ) -> None:
        ext.paged_prefill_attention(o, q, *kv, *meta_tensors, batch.scale)

    call(out, batch.query, caches, tensors)
    with pytest.raises(RuntimeError, match="query and out must be float32"):
        call(out.double(), batch.query.double(), [c.double() for c in caches], tensors)
    # A bf16 cache is read (test_cpu_bf16_cache.py); mixed or FP8 caches are refused.
    call(out, batch.query, [c.bfloat16() for c in caches], tensors)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches"):
        call(out, batch.query, [caches[0], caches[1].bfloat16()], tensors)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches"):
        call(out, batch.query, [c.to(torch.float8_e4m3fn) for c in caches], tensors)
    with pytest.raises(RuntimeError, match="block_tables must be a contiguous int32"):
        call(out, batch.query, caches, [tensors[0].long(), *tensors[1:]])
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        bad_table = tensors[0].clone()
        bad_table[0, 1] = batch.key_cache.shape[0]
        call(out, batch.query, caches, [bad_table, *tensors[1:]])
    with pytest.raises(RuntimeError, match=r"query_lens\[0\] = 13 out of range"):
        call(out, batch.query, caches, [*tensors[:3], torch.tensor([13], dtype=torch.int32)])
    with pytest.raises(RuntimeError, match=r"query_starts\[0\] = 1 out of range"):
        call(out, batch.query, caches, [*tensors[:2], torch.tensor([1]), tensors[3]])
