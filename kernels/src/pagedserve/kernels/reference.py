"""Deliberately simple dense attention over the paged cache, for tests only.

Slow on purpose: it rebuilds each sequence's contiguous K/V token by token from the cache
slots and computes softmax(Q K^T * scale + causal mask) V in float64, so it is easy to
check by eye and shares no indexing code with the optimised path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dense_causal_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """query: [T, H, D]; caches: [num_blocks, block_size, KVH, D]. Returns float64 [T, H, D]."""
    block_size = key_cache.shape[1]
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    flat_k = key_cache.reshape(-1, num_kv_heads, key_cache.shape[3]).double()
    flat_v = value_cache.reshape(-1, num_kv_heads, value_cache.shape[3]).double()
    outputs = []
    start = 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        # k, v: [seq_len, H, D] with each kv head repeated for its query heads
        k = flat_k[slots].repeat_interleave(group, dim=1)
        v = flat_v[slots].repeat_interleave(group, dim=1)
        q = query[start : start + q_len].double()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    if not outputs:
        return query.new_zeros(query.shape, dtype=torch.float64)
    return torch.cat(outputs, dim=0)
