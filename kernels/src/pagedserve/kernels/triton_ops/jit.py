"""The @triton.jit kernels. Launchers (typed, checked) live next door; see docs/kernels.md.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] with head_dim contiguous;
slot = block * block_size + offset. Strides are passed in elements.

Interpreter-mode workarounds (TRITON_INTERPRET=1, triton 3.9), selected by the INTERPRET
constexpr so compiled GPU code is untouched:
- bf16 `tl.dot` returns garbage: dot operands are rounded to the dot dtype (as the GPU
  would) and then widened to fp32, so the product sees the same values as on the GPU;
- fp32 -> bf16 casts truncate: `_round_to_bf16` rounds to nearest even in integer
  arithmetic first, so the cast only drops zero bits;
- fp32 -> fp8 casts drop the rounding carry and do not saturate: fp8 quantization never
  relies on the cast's rounding (always, not only under the interpreter), see `_fp8_grid`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, still in fp32 (only for finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = bits & -65536  # 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(DTYPE), rounding to nearest even for bf16 under the interpreter too."""
    if INTERPRET and DTYPE == tl.bfloat16:
        return _round_to_bf16(x.to(tl.float32)).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def _dot_operand(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x as a dot operand of DTYPE; under the interpreter, DTYPE-rounded values held in fp32."""
    if INTERPRET:
        if DTYPE == tl.float32:
            return x.to(tl.float32)
        else:
            return _cast(x, DTYPE, INTERPRET).to(tl.float32)
    else:
        return x.to(DTYPE)


@triton.jit
def _fp8_grid(x, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Saturate x (fp32) to +-FP8_MAX and round it to the nearest-even value of the FP8 grid.

    The result is an fp32 value the FP8 format holds exactly, so the final cast is exact
    whatever its rounding mode. The grid step near x is 2^(e - MANT_BITS) with e the binary
    exponent of x, floored at MIN_EXP (the format's smallest normal exponent, below which the
    step stays fixed: subnormals). x / step then lies below 2^(MANT_BITS + 1) in magnitude,
    and adding and subtracting 1.5 * 2^23 rounds it to an integer, ties to even, by fp32's
    own addition rounding (no fast-math: Triton does not reassociate float adds). Steps
    are powers of two, so scaling by them is exact.
    """
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP) - MANT_BITS
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    rounded = ((x * inv_step + 12582912.0) - 12582912.0) * step
    # The addition turns small negatives into +0; keep x's sign (as a cast would: -0).
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_inv_scale,
    v_inv_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    """One program per token: its [KVH, D] key and value rows into their cache slot.

    A negative slot means "no slot" (a padding token) and writes nothing.
    """
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
        if FP8:
            k = _fp8_grid(k.to(tl.float32) * k_inv_scale, FP8_MAX, MANT_BITS, MIN_EXP)
            v = _fp8_grid(v.to(tl.float32) * v_inv_scale, FP8_MAX, MANT_BITS, MIN_EXP)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    work_row_ptr,
    work_num_queries_ptr,
    work_first_pos_ptr,
    work_table_row_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    split_len,
    block_size,
    GROUP: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Causal attention of one work item's queries, for one kv head, over the paged cache.

    Grid: (work items, kv heads, NUM_SPLITS). A work item is up to BLOCK_Q consecutive query
    tokens of one sequence: flat batch rows work_row.. (+work_num_queries), at sequence
    positions work_first_pos.., whose block table is row work_table_row of block_tables.
    Query token j sees keys 0..first_pos + j. The GROUP query heads that share the kv head
    are rows of the same tile (BLOCK_Q x HEADS_PAD rows), so each K/V tile is loaded once
    for all of them.

    K/V are loaded token by token through the block table (any block size), converted to
    DOT_DTYPE (FP8 -> fp32 -> DOT_DTYPE is exact, so FP8 dequantization costs only the
    scales: qk_scale = softmax scale * k_scale * log2(e) and v_scale at the end). Online
    softmax in base 2, fp32 accumulators.

    NUM_SPLITS == 1 writes the normalized output. With NUM_SPLITS > 1 (flash decoding),
    split s covers keys [s * split_len, (s + 1) * split_len) and writes its unnormalized
    accumulator, running max and sum to the partial buffers ([work, head, split, ...]) for
    reduce_splits_kernel.
    """
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(work_row_ptr + work).to(tl.int64)
    num_queries = tl.load(work_num_queries_ptr + work)
    first_pos = tl.load(work_first_pos_ptr + work)
    table = block_tables_ptr + tl.load(work_table_row_ptr + work).to(tl.int64) * stride_bt

    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PAD
    m = tl.arange(0, BLOCK_M)
    q_idx = m // HEADS_PAD
    head = kv_head * GROUP + m % HEADS_PAD
    row_ok = (q_idx < num_queries) & (m % HEADS_PAD < GROUP)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        query_ptr + (row0 + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _dot_operand(q, DOT_DTYPE, INTERPRET)
    q_pos = first_pos + q_idx

    kv_end = first_pos + num_queries
    kv_start = 0
    if NUM_SPLITS > 1:
        kv_start = split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for n0 in range(kv_start, kv_end, TILE_N):
        n = n0 + tl.arange(0, TILE_N)
        n_ok = n < kv_end
        block = tl.load(table + n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (n % block_size) * stride_cs + kv_head * stride_ch
        # k, v: [TILE_N, DIM_PAD], rows read along head_dim (contiguous in the cache)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(key_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k = _dot_operand(k.to(tl.float32), DOT_DTYPE, INTERPRET)
        v = _dot_operand(v.to(tl.float32), DOT_DTYPE, INTERPRET)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; shift it by 0, not by -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = _dot_operand(p, DOT_DTYPE, INTERPRET)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        o = _cast(o, out_ptr.dtype.element_ty, INTERPRET)
        dst = out_ptr + (row0 + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o, mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partial_out: [work, H, NUM_SPLITS, DIM_PAD]; partial_max / partial_sum: [work, H, NUM_SPLITS]
        num_heads = tl.num_programs(1) * GROUP
        base = (work.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + base, m_i, mask=row_ok)
        tl.store(partial_sum_ptr + base, l_i, mask=row_ok)
        tl.store(partial_out_ptr + base[:, None] * DIM_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    work_row_ptr,
    v_scale,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Combine the splits of one (work item, query head): grid (work items, heads).

    Only single-query work items take the split path, so a work item is one output row.
    Empty splits (past the sequence's end) carry max -inf and sum 0 and weigh nothing.
    """
    work = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    base = (work.to(tl.int64) * num_heads + head) * NUM_SPLITS
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    m_s = tl.load(partial_max_ptr + base + sp)
    l_s = tl.load(partial_sum_ptr + base + sp)
    m = tl.max(m_s, 0)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m))
    acc = tl.load(partial_out_ptr + (base + sp)[:, None] * DIM_PAD + d[None, :])
    o = tl.sum(acc * w[:, None], 0) * (v_scale / tl.sum(l_s * w, 0))
    o = _cast(o, out_ptr.dtype.element_ty, INTERPRET)
    row = tl.load(work_row_ptr + work).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o, mask=d < HEAD_DIM)


@triton.jit
def copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    block_numel,
    CHUNK: tl.constexpr,
):
    """dst[dst_ids[i]] = src[src_ids[i]] for whole blocks of block_numel elements.

    Grid: (pairs, chunks per block). The launcher passes integer views of the caches, so
    bits move unchanged whatever the element type (FP8 included).
    """
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ids_ptr + i).to(tl.int64)
    dst = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(src_ptr + src * block_numel + offs, mask=mask)
    tl.store(dst_ptr + dst * block_numel + offs, x, mask=mask)
