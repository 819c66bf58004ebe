"""Paged attention over a flattened varlen batch.

Implementations (`impl`): "triton" (pagedserve.kernels.triton_ops: one kernel family for prefill
chunks and decodes, split-KV for long decodes; the default for CUDA tensors), and the CPU
paths below, "cpp" and "torch", which are also the reference the Triton kernels are tested
against. An FP8 cache is read as fp8 values times the layer's k_scale / v_scale.

Decode queries (one new token per sequence) on CPU in fp32 go to the C++ kernel
(kernels/src/pagedserve/kernels/cpu/paged_attention.cpp, built by pagedserve.kernels.cpu_ext when pagedserve.kernels.backend resolves
"cpp"), which reads K/V straight from the paged cache: fp32, or FP8 widened in the kernel
with the scales folded in as the Triton kernel folds them. Otherwise they take the torch path: length-sorted groups,
each gathering its sequences' K/V blocks with one index_select per tensor (whole blocks are
contiguous in the cache, so this is a memcpy per block) and running one batched SDPA with a
key-length mask. Prefill chunks with an fp32 query over an fp32 cache take the C++ prefill
kernel under "cpp" (kernels/src/pagedserve/kernels/cpu/prefill_attention.cpp: every prefill sequence in one call,
K/V read in place); otherwise one SDPA per sequence with the right causal alignment. SDPA's
CPU flash kernel accepts the strided K/V views directly and handles GQA without repeating KV
heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import AttentionImpl, attention_impl_for, cpp_cache_dtype
from pagedserve.kernels.checks import check_attention_inputs
from pagedserve.kernels.cpu_ext import CpuKernels, load_cpu_kernels
from pagedserve.kernels.fp8 import is_fp8
from pagedserve.kernels.metadata import AttentionMetadata


def _decode_kernels(
    query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata, impl: AttentionImpl
) -> CpuKernels | None:
    """The C++ kernels if this call's decode or prefill tokens use them (impl "cpp"), else None."""
    if impl != "cpp":
        return None
    if not (query.device.type == "cpu" and query.dtype == torch.float32 and cpp_cache_dtype(key_cache.dtype)):
        raise ValueError(
            f"impl='cpp' needs a float32 CPU query and a float32, bfloat16 or FP8 cache, got {query.dtype} / "
            f"{key_cache.dtype} on {query.device}; use impl=None (by device)"
        )
    # The prefill kernel reads fp32 and bf16 caches: FP8 prefills keep SDPA.
    if meta.num_decode_tokens == 0 and (not meta.prefills or is_fp8(key_cache.dtype)):
        return None
    return load_cpu_kernels(strict=True)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    impl: AttentionImpl | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    query: [T, H, D] (any strides); key_cache, value_cache: [num_blocks, block_size, KVH, D]
    already holding this step's new tokens (write_kv_cache first). H = KVH * group, query head
    h reads kv head h // group. Returns a new contiguous [T, H, D] in the query dtype. An FP8
    cache holds K / k_scale and V / v_scale (scales must be 1.0 for other caches).

    impl (pagedserve.kernels.backend) is the concrete path: "torch" (SDPA); "cpp", the C++ decode kernel
    (ValueError unless the query is fp32 on the CPU and the cache fp32 or FP8, RuntimeError if
    it cannot be built) and, over an fp32 cache, the C++ prefill kernel (over FP8, prefill
    tokens take SDPA); "triton", the Triton kernels (CUDA,
    or the CPU under TRITON_INTERPRET=1). The engine passes the one resolve_backend chose at
    start-up; None resolves by device on each call (Triton on CUDA; on the CPU "cpp" for an
    fp32 query over an fp32 or FP8 cache where the kernel builds, building it on the first
    such call, else "torch").
    """
    check_attention_inputs(query, key_cache, value_cache, meta, k_scale, v_scale)
    impl = attention_impl_for(impl, query.device, query.dtype, key_cache.dtype)
    if impl == "triton":
        from pagedserve.kernels.triton_ops import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, meta, scale, k_scale, v_scale)
    return paged_attention_torch(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        k_scale,
        v_scale,
        decode_kernels=_decode_kernels(query, key_cache, meta, impl),
    )


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    decode_kernels: CpuKernels | None = None,
) -> torch.Tensor:
    """The torch reference (inputs already checked); decode_kernels: use the C++ kernels for
    the decode tokens and, over an fp32 cache, the prefill tokens.

    FP8 K/V are gathered as stored, widened to the query dtype (exact: every FP8 value is a
    bf16/fp16/fp32 value) and their scales folded into the softmax scale and the output. The
    C++ kernel widens FP8 itself and folds the same scales (scale * k_scale, then v_scale).
    A bf16 cache under an fp32 query is widened the same way, without scales.
    """
    kernels = decode_kernels
    fp8 = is_fp8(key_cache.dtype)
    widen = key_cache.dtype != query.dtype  # FP8, or a bf16 cache of an fp32 model
    if fp8:
        scale *= k_scale
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = meta.block_size
    out = query.new_empty(num_tokens, num_heads, head_dim)
    # out_grouped: [T, KVH, group, D], a view of out in the per-kv-head layout
    out_grouped = out.view(num_tokens, num_kv_heads, group, head_dim)

    prefills = meta.prefills
    if kernels is not None:
        # The kernels read any [T, H, D] strides but need head_dim contiguous.
        q = query if query.stride(2) == 1 else query.contiguous()
        if meta.num_decode_tokens:
            kernels.paged_decode_attention(
                out,
                q,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                meta.decode_token_rows,
                scale,
                v_scale if fp8 else 1.0,
            )
        if prefills and not fp8:
            # Every prefill sequence in one call, per-sequence tensors built once per step.
            kernels.paged_prefill_attention(
                out,
                q,
                key_cache,
                value_cache,
                meta.prefill_block_tables,
                meta.prefill_seq_lens,
                meta.prefill_query_starts,
                meta.prefill_query_lens,
                scale,
            )
            prefills = ()
        if not prefills:
            return out
    # Gathers go into step-wide scratch buffers; each group's attention finishes with its
    # slice before the next group overwrites it (ops on one device run in order).
    k_buf, v_buf = meta.gather_workspace(key_cache, meta.max_prefill_blocks if kernels else None)

    for g in meta.decode_groups if kernels is None else ():
        n, max_len = g.num_seqs, g.max_blocks * block_size
        # One query token per sequence, so the `group` query heads sharing a kv head are
        # folded into SDPA's query-length axis: one [group, D] x [D, L] product per kv head
        # instead of `group` matrix-vector products that each re-read K and V (faster than
        # enable_gqa, whose single-query path is slow in bf16).
        # q: [n, KVH, group, D]
        q = query.index_select(0, g.token_indices).view(n, num_kv_heads, group, head_dim)
        # k, v: [n, KVH, max_len, D], strided views of the gathered [n, max_len, KVH, D]
        nblocks = g.block_ids.shape[0]
        k = torch.index_select(key_cache, 0, g.block_ids, out=k_buf[:nblocks])
        v = torch.index_select(value_cache, 0, g.block_ids, out=v_buf[:nblocks])
        if widen:
            k, v = k.to(query.dtype), v.to(query.dtype)
        if g.pad_rows is not None:
            # Stale slots past each sequence's end may hold inf/NaN (see DecodeGroup.pad_rows).
            k.view(n * max_len, num_kv_heads, head_dim).index_fill_(0, g.pad_rows, 0.0)
            v.view(n * max_len, num_kv_heads, head_dim).index_fill_(0, g.pad_rows, 0.0)
        k = k.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(n, max_len, num_kv_heads, head_dim).transpose(1, 2)
        # o: [n, KVH, group, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask, scale=scale)
        if fp8:
            o = o * v_scale
        out_grouped.index_copy_(0, g.token_indices, o)

    for p in prefills:
        nblocks = p.block_ids.shape[0]
        # k, v: [seq_len, KVH, D] after slicing, the sequence's contiguous context
        k = torch.index_select(key_cache, 0, p.block_ids, out=k_buf[:nblocks])
        v = torch.index_select(value_cache, 0, p.block_ids, out=v_buf[:nblocks])
        if widen:
            k, v = k.to(query.dtype), v.to(query.dtype)
        k = k.view(nblocks * block_size, num_kv_heads, head_dim)
        v = v.view(nblocks * block_size, num_kv_heads, head_dim)
        # k, v: [1, KVH, seq_len, D]; q: [1, H, query_len, D]. The leading batch dim matters:
        # on CPU, 3-D inputs fall back to SDPA's slower unfused math path.
        k = k[: p.seq_len].transpose(0, 1).unsqueeze(0)
        v = v[: p.seq_len].transpose(0, 1).unsqueeze(0)
        q = query[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
        # is_causal in SDPA is top-left aligned, which is only right without a cached prefix;
        # otherwise the metadata carries the bottom-right aligned mask.
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=p.causal_mask,
            is_causal=p.causal_mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[p.token_start : p.token_end] = o[0].transpose(0, 1) * v_scale if fp8 else o[0].transpose(0, 1)
    return out
