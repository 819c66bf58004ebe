"""Paged KV ops against the dense float64 reference (pagedserve.kernels.reference).

fp32 decode tests run both decode implementations: impl="torch" (gathers + SDPA) and
impl="cpp" (the C++ kernel, which must build here: no skip). See also test_cpu_kernels.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedserve.kernels import (
    AttentionMetadata,
    build_attention_metadata,
    copy_blocks,
    paged_attention,
    write_kv_cache,
)
from pagedserve.kernels.backend import AttentionImpl
from pagedserve.kernels.metadata import DECODE_GROUP_MAX_SEQS, DECODE_GROUP_MAX_TOKENS
from pagedserve.kernels.reference import dense_causal_attention_reference

# fp32: the kernel and the float64 reference differ only by fp32 rounding in
# O(seq_len * head_dim) accumulations of O(1) values, about 1e-6 here.
FP32_ATOL = 1e-5
# bf16 keeps 8 mantissa bits: rounding the output alone costs up to 2^-9 relative (~2e-3
# abs on |out| <= ~4), and the CPU flash kernel also rounds the softmax probabilities to
# bf16 before the P @ V product. Inputs are the same bf16 values for both sides, so this
# bound covers only the kernel's internal rounding, not input quantisation.
BF16_ATOL = 3e-2
# fp16 keeps 11 mantissa bits, 8x finer than bf16.
FP16_ATOL = 4e-3


@dataclass
class Batch:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    decode_group_max_tokens: int = DECODE_GROUP_MAX_TOKENS,
    decode_group_max_seqs: int = DECODE_GROUP_MAX_SEQS,
    decode_group_min_seqs: int | None = None,
    nonfinite_garbage: bool = False,
    device: str = "cpu",
) -> Batch:
    """Random paged batch whose new K/V are already written to the cache.

    Physical blocks are a random permutation (never the identity) with spare blocks, and
    every slot starts out holding large finite garbage, so reading a wrong or stale slot
    shows up as a large error.
    """
    gen = torch.Generator().manual_seed(seed)
    nblocks = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(nblocks) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables: list[list[int]] = []
    i = 0
    for n in nblocks:
        block_tables.append(perm[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = (torch.randn(shape, generator=gen) * 30).to(dtype)
    value_cache = (torch.randn(shape, generator=gen) * 30).to(dtype)
    if nonfinite_garbage:
        # What a freed block may hold after an earlier request overflowed in half precision.
        garbage = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
        key_cache = garbage[torch.arange(key_cache.numel()) % 3].view(shape)
        value_cache = garbage[(torch.arange(value_cache.numel()) + 1) % 3].view(shape)
    # The cached prefix of each sequence: ordinary values at its real slots.
    for table, seq_len in zip(block_tables, seq_lens, strict=True):
        for pos in range(seq_len):
            block, off = table[pos // block_size], pos % block_size
            key_cache[block, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            value_cache[block, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    t = sum(query_lens)
    num_heads = num_kv_heads * group
    query = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    query, key, value = query.to(device), key.to(device), value.to(device)
    meta = build_attention_metadata(
        query_lens,
        seq_lens,
        block_tables,
        block_size,
        device,
        decode_group_max_tokens=decode_group_max_tokens,
        decode_group_max_seqs=decode_group_max_seqs,
        decode_group_min_seqs=decode_group_min_seqs,
    )
    write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    return Batch(
        query_lens,
        seq_lens,
        block_tables,
        block_size,
        key_cache,
        value_cache,
        query,
        key,
        value,
        meta,
        head_dim**-0.5,
    )


# Both decode paths, for fp32 tests.
IMPLS: list[AttentionImpl] = ["torch", "cpp"]


def max_error(batch: Batch, query: torch.Tensor | None = None, impl: AttentionImpl | None = None) -> float:
    q = batch.query if query is None else query
    out = paged_attention(q, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl=impl)
    assert out.shape == batch.query.shape
    assert out.dtype == batch.query.dtype
    ref = dense_causal_attention_reference(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    return (out.double() - ref).abs().max().item()


# Decodes with ragged contexts (partial last blocks, an exact multiple of 32, a 1-token
# prompt), a fresh prompt and two chunked-prefill chunks (cached prefix + new tokens).
MIXED_QUERY_LENS = [1, 7, 1, 1, 5, 1, 9, 1]
MIXED_SEQ_LENS = [37, 7, 64, 1, 23, 100, 41, 18]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (2, 3), (1, 8)])
def test_mixed_batch_matches_reference_fp32(
    num_kv_heads: int, group: int, block_size: int, head_dim: int, impl: AttentionImpl
) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    assert batch.meta.num_decode_tokens == 5 and len(batch.meta.prefills) == 3
    assert max_error(batch, impl=impl) < FP32_ATOL


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, BF16_ATOL), (torch.float16, FP16_ATOL)])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 8)])
def test_mixed_batch_matches_reference_half(
    dtype: torch.dtype, atol: float, num_kv_heads: int, group: int
) -> None:
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=16,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        dtype=dtype,
    )
    assert max_error(batch) < atol


def test_many_decode_groups() -> None:
    # Tight grouping limits force several length-sorted groups, padding within each.
    rng = random.Random(1)
    seq_lens = [rng.randint(1, 200) for _ in range(40)]
    batch = make_batch(
        [1] * 40,
        seq_lens,
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_dim=64,
        decode_group_max_tokens=256,
        decode_group_max_seqs=4,
    )
    groups = batch.meta.decode_groups
    assert len(groups) > 5
    rows = torch.cat([g.token_indices for g in groups]).sort().values
    assert rows.tolist() == list(range(40))
    for g in groups:
        assert g.num_seqs <= 4
        assert g.block_ids.shape == (g.num_seqs * g.max_blocks,)
        # Decode rows are the sequences themselves here, so the mask rows are their lengths.
        member_lens = [seq_lens[row] for row in g.token_indices.tolist()]
        assert g.key_mask.sum(dim=-1).flatten().tolist() == member_lens
        assert g.max_blocks == (max(member_lens) + 15) // 16
    assert max_error(batch, impl="torch") < FP32_ATOL


@pytest.mark.parametrize("impl", IMPLS)
def test_long_chunked_prefill_and_decode(impl: AttentionImpl) -> None:
    # A 3rd chunk of a long prompt next to decodes longer than one group's token budget.
    batch = make_batch(
        [64, 1, 1], [300, 513, 47], block_size=16, num_kv_heads=2, group=4, head_dim=64, seed=3
    )
    assert max_error(batch, impl=impl) < FP32_ATOL


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_query_like_the_transformers_hook(impl: AttentionImpl) -> None:
    # The attention hook passes query[0].transpose(0, 1) of a [1, H, T, D] tensor.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=3, group=3, head_dim=64)
    strided = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert max_error(batch, strided, impl=impl) < FP32_ATOL


@pytest.mark.parametrize(
    ("dtype", "atol", "impl"),
    [
        (torch.float32, FP32_ATOL, "torch"),
        (torch.float32, FP32_ATOL, "cpp"),
        (torch.bfloat16, BF16_ATOL, "torch"),
    ],
)
def test_stale_nonfinite_slots_do_not_leak(dtype: torch.dtype, atol: float, impl: AttentionImpl) -> None:
    # Every slot outside the sequences' contexts (tails of last blocks, spare blocks that pad
    # decode groups) holds NaN/inf; the kernel must never let them into a result.
    batch = make_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
        nonfinite_garbage=True,
    )
    assert any(g.pad_rows is not None for g in batch.meta.decode_groups)
    assert max_error(batch, impl=impl) < atol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uses_fused_sdpa_kernel(dtype: torch.dtype) -> None:
    # Performance guard: every SDPA call must be eligible for the fused flash kernel. Inputs
    # it rejects (e.g. 3-D tensors on CPU) silently fall back to the slower math path;
    # restricting SDPA to flash turns that fallback into an error.
    batch = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype
    )
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="torch"
        )
        if dtype == torch.float32:
            paged_attention(
                batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp"
            )


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl: AttentionImpl) -> None:
    meta = build_attention_metadata([], [], [], 16, "cpu")
    cache = torch.zeros(4, 16, 2, 8)
    write_kv_cache(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), cache, cache.clone(), meta.slot_mapping)
    out = paged_attention(torch.zeros(0, 4, 8), cache, cache.clone(), meta, 1.0, impl=impl)
    assert out.shape == (0, 4, 8)


@settings(max_examples=30, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(st.one_of(st.just(1), st.integers(1, 12)), st.integers(0, 40)),
        min_size=1,
        max_size=6,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 3), (1, 4)]),
    head_dim=st.sampled_from([8, 64]),
    grouping=st.sampled_from([(2048, 16, None), (16, 1, None), (64, 2, 2), (16, 4, 3)]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_reference(
    seqs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    grouping: tuple[int, int, int | None],
    seed: int,
) -> None:
    query_lens = [q for q, _ in seqs]
    seq_lens = [q + cached for q, cached in seqs]
    batch = make_batch(
        query_lens,
        seq_lens,
        block_size=block_size,
        num_kv_heads=heads[0],
        group=heads[1],
        head_dim=head_dim,
        seed=seed,
        decode_group_max_tokens=grouping[0],
        decode_group_max_seqs=grouping[1],
        decode_group_min_seqs=grouping[2],
    )
    for impl in IMPLS:
        assert max_error(batch, impl=impl) < FP32_ATOL


# ---- metadata -------------------------------------------------------------------------


def test_slot_mapping_and_layout() -> None:
    meta = build_attention_metadata([1, 3, 2], [5, 3, 6], [[7, 2], [4], [1, 0, 9]], 4, "cpu")
    # seq 0: position 4 -> block 2, offset 0; seq 1: positions 0..2 in block 4;
    # seq 2: positions 4, 5 -> block 0, offsets 0, 1
    assert meta.slot_mapping.tolist() == [8, 16, 17, 18, 0, 1]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == [5, 3, 6]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 0], [1, 0, 9]]
    assert (meta.num_tokens, meta.num_seqs, meta.max_query_len, meta.max_seq_len) == (6, 3, 3, 6)
    assert meta.num_decode_tokens == 1
    # The C++ decode kernel's view: just sequence 0, whose query is row 0.
    assert meta.decode_block_tables.tolist() == [[7, 2]]
    assert meta.decode_block_tables.dtype == torch.int32
    assert meta.decode_seq_lens.tolist() == [5] and meta.decode_seq_lens.dtype == torch.int32
    assert meta.decode_token_rows.tolist() == [0] and meta.decode_token_rows.dtype == torch.int64
    assert [(p.token_start, p.token_end, p.seq_len) for p in meta.prefills] == [(1, 4, 3), (4, 6, 6)]
    assert meta.prefills[0].causal_mask is None  # fresh prompt: plain is_causal
    mask = meta.prefills[1].causal_mask
    assert mask is not None
    assert mask.tolist() == [[True] * 5 + [False], [True] * 6]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "tables", "match"),
    [
        ([1], [5], [[0]], "needs 2"),
        ([0], [5], [[0, 1]], "query_len must be >= 1"),
        ([4], [3], [[0]], "seq_lens must be >= query_lens"),
        ([1, 1], [5], [[0, 1]], "one entry per sequence"),
        ([1], [2], [[-1]], "non-negative"),
        # two sequences writing their new token into one shared block slot
        ([1, 1], [3, 3], [[5], [5]], "duplicate slots"),
    ],
)
def test_metadata_rejects_bad_input(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(query_lens, seq_lens, tables, 4, "cpu")


# ---- write_kv_cache -------------------------------------------------------------------


def test_write_kv_cache_places_exact_values() -> None:
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    key_cache = torch.full((num_blocks, block_size, kvh, d), -7.0)
    value_cache = torch.full((num_blocks, block_size, kvh, d), -9.0)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([13, 0, 23, 5, 6], dtype=torch.int64)
    # Strided like the hook's key[0].transpose(0, 1).
    key = torch.randn(kvh, 5, d).transpose(0, 1)
    value = torch.randn(kvh, 5, d).transpose(0, 1)
    write_kv_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        block, off = divmod(slot, block_size)
        assert torch.equal(key_cache[block, off], key[t])
        assert torch.equal(value_cache[block, off], value[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(key_cache.view(-1, kvh, d)[untouched], before_k.view(-1, kvh, d)[untouched])
    assert torch.equal(value_cache.view(-1, kvh, d)[untouched], before_v.view(-1, kvh, d)[untouched])


def _cache() -> torch.Tensor:
    return torch.zeros(4, 4, 2, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": torch.zeros(3, 3, 8)}, "key must be"),
        ({"value": torch.zeros(3, 2, 4)}, "value shape"),
        ({"key": torch.zeros(3, 2, 8, dtype=torch.float64)}, "key dtype"),
        ({"slot_mapping": torch.arange(3, dtype=torch.int32)}, "int64"),
        ({"slot_mapping": torch.arange(2)}, "one slot per token"),
        ({"value_cache": torch.zeros(4, 4, 2, 8, dtype=torch.float16)}, "value_cache dtype"),
        ({"value_cache": torch.zeros(4, 4, 2, 4)}, "value_cache shape"),
        (
            {"key_cache": torch.zeros(4, 4, 8, 2).transpose(2, 3), "value_cache": torch.zeros(4, 4, 2, 8)},
            "contiguous",
        ),
        ({"key_cache": torch.zeros(16, 2, 8), "value_cache": torch.zeros(16, 2, 8)}, "key_cache must be"),
        ({"key": torch.zeros(3, 2, 8, device="meta")}, "key is on meta"),
    ],
)
def test_write_kv_cache_validation(kwargs: dict[str, torch.Tensor], match: str) -> None:
    args: dict[str, Any] = {
        "key": torch.zeros(3, 2, 8),
        "value": torch.zeros(3, 2, 8),
        "key_cache": _cache(),
        "value_cache": _cache(),
        "slot_mapping": torch.arange(3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)


# ---- paged_attention validation ---------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "cache_kwargs", "match"),
    [
        (torch.zeros(3, 4, 8, dtype=torch.float64), {}, "query dtype"),
        (torch.zeros(3, 3, 8), {}, "not a multiple"),
        (torch.zeros(3, 4, 16), {}, "head_dim"),
        (torch.zeros(2, 4, 8), {}, "describes 3"),
        (torch.zeros(3, 4), {}, "query must be"),
        (torch.zeros(3, 4, 8), {"block_size": 8}, "block_size"),
        (torch.zeros(3, 4, 8, device="meta"), {}, "query is on meta"),
    ],
)
def test_paged_attention_validation(query: torch.Tensor, cache_kwargs: dict[str, int], match: str) -> None:
    meta = build_attention_metadata([1, 2], [3, 2], [[0], [1]], 4, "cpu")
    block_size = cache_kwargs.get("block_size", 4)
    cache = torch.zeros(4, block_size, 2, 8)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, cache, cache.clone(), meta, 1.0)


# ---- copy_blocks ----------------------------------------------------------------------


def test_copy_blocks_all_layers_and_overlap() -> None:
    layers = 3
    key_caches = [torch.randn(5, 4, 2, 8) for _ in range(layers)]
    value_caches = [torch.randn(5, 4, 2, 8) for _ in range(layers)]
    before_k = [c.clone() for c in key_caches]
    before_v = [c.clone() for c in value_caches]
    # Block 1 is both a destination and a source: sources are read before any write.
    copy_blocks(key_caches, value_caches, [(1, 3), (0, 1)])
    for after, before in zip(key_caches + value_caches, before_k + before_v, strict=True):
        assert torch.equal(after[3], before[1])
        assert torch.equal(after[1], before[0])
        for b in (0, 2, 4):
            assert torch.equal(after[b], before[b])


def test_copy_blocks_tensor_pairs_and_empty() -> None:
    key_caches, value_caches = [torch.randn(3, 2, 1, 4)], [torch.randn(3, 2, 1, 4)]
    before = key_caches[0].clone()
    copy_blocks(key_caches, value_caches, [])
    assert torch.equal(key_caches[0], before)
    copy_blocks(key_caches, value_caches, torch.tensor([[2, 0]]))
    assert torch.equal(key_caches[0][0], before[2])


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([[0, 1], [2, 1]], "duplicate destination"),
        ([[0, 5]], r"in \[0, 5\)"),
        ([[-1, 2]], r"in \[0, 5\)"),
        ([[0, 1, 2]], "pairs"),
    ],
)
def test_copy_blocks_validation(pairs: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        copy_blocks([torch.zeros(5, 4, 2, 8)], [torch.zeros(5, 4, 2, 8)], pairs)


def test_copy_blocks_rejects_mismatched_layers() -> None:
    with pytest.raises(ValueError, match="share shape"):
        copy_blocks(
            [torch.zeros(5, 4, 2, 8), torch.zeros(6, 4, 2, 8)],
            [torch.zeros(5, 4, 2, 8), torch.zeros(6, 4, 2, 8)],
            [(0, 1)],
        )
    with pytest.raises(ValueError, match="value caches"):
        copy_blocks([torch.zeros(5, 4, 2, 8)], [], [(0, 1)])
