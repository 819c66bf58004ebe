"""Per-step attention metadata, built once and shared by every layer of the step.

Everything that depends only on the batch composition (slot mapping, gather indices,
masks, the decode/prefill split) is computed here, so the per-layer ops do no index
arithmetic and no host-side work beyond launching a few tensor ops.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

# Decode sequences are attended in groups padded to the longest member. Small groups of
# similar length waste little work on padding and keep each group's gathered K/V
# (group tokens x KVH x D x 2) in the CPU caches while the attention reads it back (one
# gather of all groups up front is slower); larger groups amortise the fixed per-op cost.
# Tuned with benchmarks/src/pagedserve/benchmarks/paged_attention_cpu.py.
DECODE_GROUP_MAX_TOKENS = 4096
DECODE_GROUP_MAX_SEQS = 16
# A group also closes when the next (shorter) sequence would leave more than this
# fraction of its padded row unused.
DECODE_GROUP_MAX_PAD_FRACTION = 0.25
# Even past the token budget a group takes min_group_seqs sequences (when their lengths
# allow), by default one per intra-op thread: SDPA parallelises over (sequence, kv head)
# pairs, and one long sequence with few kv heads leaves threads idle, while on one thread
# pairing long sequences only adds padding.


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences (one query token each) attended together in one batched call."""

    # token_indices: [n] int64, rows of the flattened batch holding these sequences' queries
    token_indices: torch.Tensor
    # block_ids: [n * max_blocks] int64, block tables row-major; rows shorter than max_blocks
    # are padded with a valid block id (its copies are masked out and zeroed, see pad_rows)
    block_ids: torch.Tensor = field(repr=False)
    # key_mask: [n, 1, 1, max_blocks * block_size] bool, True where the key position < seq_len
    key_mask: torch.Tensor = field(repr=False)
    # pad_rows: [num_padded] int64, the positions of the gathered [n * max_blocks * block_size]
    # token rows that lie past their sequence's end (None when there are none). Those slots
    # hold whatever the block's earlier owner left, possibly inf/NaN, and a masked key still
    # enters P @ V with weight 0 (0 * NaN = NaN), so the gathered copies are zeroed.
    pad_rows: torch.Tensor | None = field(repr=False)
    num_seqs: int
    max_blocks: int


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with several new query tokens (a prompt, or a chunk of one)."""

    token_start: int  # its query tokens are rows [token_start, token_end) of the batch
    token_end: int
    seq_len: int  # context length including the new tokens
    # block_ids: [ceil(seq_len / block_size)] int64
    block_ids: torch.Tensor = field(repr=False)

    @property
    def query_len(self) -> int:
        return self.token_end - self.token_start

    @functools.cached_property
    def causal_mask(self) -> torch.Tensor | None:
        """[query_len, seq_len] bool (True = may attend), or None when there is no cached
        prefix: then the mask is plain top-left causal and SDPA's is_causal skips the masked
        half of the work instead of computing and discarding it. Built on first use, once per
        step (the torch path's layers share it); the C++ prefill kernel never needs it."""
        q_len, s_len = self.query_len, self.seq_len
        if s_len == q_len:
            return None
        # the chunk's query j sits at position s_len - q_len + j and sees keys 0..that position
        device = self.block_ids.device
        query_pos = torch.arange(s_len - q_len, s_len, device=device)
        return torch.arange(s_len, device=device)[None, :] <= query_pos[:, None]


@dataclass(frozen=True)
class _DecodeGroupSpec:
    """What building the torch path's decode groups needs, kept until they are first used."""

    seqs: npt.NDArray[np.int64]
    seq_lens: npt.NDArray[np.int64]
    token_rows: npt.NDArray[np.int64]
    table: npt.NDArray[np.int64]
    max_group_tokens: int
    max_group_seqs: int
    min_group_seqs: int


@dataclass(frozen=True)
class WorkItems:
    """Work items of the Triton attention kernel: up to block_q query tokens of one sequence.

    Item i covers flat batch rows rows[i] .. rows[i] + num_queries[i] - 1, at sequence
    positions first_pos[i] .., and reads the block table row table_rows[i] of whichever
    table it was built for. All tensors are [num_items] int32 on the metadata's device.
    """

    rows: torch.Tensor
    num_queries: torch.Tensor
    first_pos: torch.Tensor
    table_rows: torch.Tensor
    num_items: int
    max_kv_len: int  # most keys any item reads


@dataclass(frozen=True)
class _HostBatch:
    """Host copies of the batch shape, kept for lazily built views (Triton work items)."""

    query_lens: npt.NDArray[np.int64]
    seq_lens: npt.NDArray[np.int64]
    query_start: npt.NDArray[np.int64]
    decode_order: npt.NDArray[np.int64]


@dataclass(frozen=True)
class AttentionMetadata:
    """What the paged KV ops need for one step of a flattened varlen batch.

    T tokens from S sequences; sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    of the batch, which are the last query_lens[s] tokens of its seq_lens[s]-token context.

    Decode sequences (one new token) are described twice: flat per-sequence tensors for the
    C++ CPU kernel (decode_block_tables, decode_seq_lens, decode_token_rows; a few small
    numpy ops) and length-sorted padded groups for the torch path (decode_groups), which
    cost more host work and are only built when first read.
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    # slot_mapping: [T] int64, cache slot (block * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    # query_start_loc: [S + 1] int32, cumulative query lengths
    query_start_loc: torch.Tensor
    # seq_lens: [S] int32
    seq_lens: torch.Tensor
    # block_tables: [S, max_blocks_per_seq] int32, rows padded with 0
    block_tables: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    num_decode_tokens: int
    # The decode sequences for the C++ kernel, longest first (the kernel hands out work in
    # this order, so long sequences start early and short ones fill in at the end):
    # decode_block_tables: [S_dec, max_decode_blocks] int32, rows padded with 0;
    # decode_seq_lens: [S_dec] int32; decode_token_rows: [S_dec] int64, the query row of each.
    decode_block_tables: torch.Tensor = field(repr=False)
    decode_seq_lens: torch.Tensor = field(repr=False)
    decode_token_rows: torch.Tensor = field(repr=False)
    # The prefill sequences (query_len > 1) for the C++ prefill kernel, in batch order (the
    # kernel orders its own work items): prefill_block_tables: [S_pre, max_prefill_blocks]
    # int32, rows padded with 0; prefill_seq_lens, prefill_query_lens: [S_pre] int32;
    # prefill_query_starts: [S_pre] int64, the first query row of each.
    prefill_block_tables: torch.Tensor = field(repr=False)
    prefill_seq_lens: torch.Tensor = field(repr=False)
    prefill_query_lens: torch.Tensor = field(repr=False)
    prefill_query_starts: torch.Tensor = field(repr=False)
    # Most blocks any single prefill sequence gathers.
    max_prefill_blocks: int
    _decode_group_spec: _DecodeGroupSpec = field(repr=False, compare=False)
    _host: _HostBatch = field(repr=False, compare=False)
    # Lazily built decode groups and scratch buffers reused by every layer of the step (see
    # gather_workspace); not part of the metadata's value.
    _groups: dict[str, tuple[DecodeGroup, ...]] = field(default_factory=dict, repr=False, compare=False)
    _workspace: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )
    _work_items: dict[tuple[str, int], WorkItems] = field(default_factory=dict, repr=False, compare=False)

    def prefill_work_items(self, block_q: int) -> WorkItems:
        """The prefill sequences cut into items of <= block_q queries (tables: block_tables),
        most keys first so the longest items start early. Built once per block_q."""
        key = ("prefill", block_q)
        items = self._work_items.get(key)
        if items is None:
            h = self._host
            seqs = np.flatnonzero(h.query_lens > 1)
            q_lens, s_lens = h.query_lens[seqs], h.seq_lens[seqs]
            per_seq = (q_lens + block_q - 1) // block_q
            seq_of = np.repeat(np.arange(seqs.size), per_seq)
            tile_of = np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
            offset = tile_of * block_q
            num_queries = np.minimum(block_q, q_lens[seq_of] - offset)
            first_pos = s_lens[seq_of] - q_lens[seq_of] + offset
            order = np.argsort(-(first_pos + num_queries), kind="stable")
            items = self._make_work_items(
                h.query_start[seqs][seq_of] + offset, num_queries, first_pos, seqs[seq_of], order
            )
            self._work_items[key] = items
        return items

    def decode_work_items(self) -> WorkItems:
        """One item per decode sequence, longest first (tables: decode_block_tables)."""
        key = ("decode", 1)
        items = self._work_items.get(key)
        if items is None:
            h = self._host
            n = h.decode_order.size
            lens = h.seq_lens[h.decode_order]
            items = self._make_work_items(
                h.query_start[h.decode_order], np.ones(n, np.int64), lens - 1, np.arange(n), np.arange(n)
            )
            self._work_items[key] = items
        return items

    def _make_work_items(
        self,
        rows: npt.NDArray[np.int64],
        num_queries: npt.NDArray[np.int64],
        first_pos: npt.NDArray[np.int64],
        table_rows: npt.NDArray[np.int64],
        order: npt.NDArray[np.int64],
    ) -> WorkItems:
        device = self.slot_mapping.device

        def as_tensor(a: npt.NDArray[np.int64]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a[order], dtype=np.int32)).to(device)

        kv_lens = first_pos + num_queries
        return WorkItems(
            rows=as_tensor(rows),
            num_queries=as_tensor(num_queries),
            first_pos=as_tensor(first_pos),
            table_rows=as_tensor(table_rows),
            num_items=int(order.size),
            max_kv_len=int(kv_lens.max()) if kv_lens.size else 0,
        )

    @property
    def decode_groups(self) -> tuple[DecodeGroup, ...]:
        """The torch path's decode groups, built on first use and kept for the step's other layers."""
        groups = self._groups.get("decode")
        if groups is None:
            spec = self._decode_group_spec
            groups = _decode_groups(
                spec.seqs,
                spec.seq_lens,
                spec.token_rows,
                spec.table,
                self.block_size,
                self.slot_mapping.device,
                spec.max_group_tokens,
                spec.max_group_seqs,
                spec.min_group_seqs,
            )
            self._groups["decode"] = groups
        return groups

    @property
    def max_gather_blocks(self) -> int:
        """Most blocks any single decode group or prefill sequence of the torch path gathers."""
        return max([g.num_seqs * g.max_blocks for g in self.decode_groups] + [self.max_prefill_blocks])

    def gather_workspace(
        self, key_cache: torch.Tensor, num_blocks: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers, each [>= num_blocks, block_size, KVH, D], made once per step.

        num_blocks defaults to max_gather_blocks (what the torch path's decode groups and
        prefills need); the C++ decode path asks for max_prefill_blocks only. Fresh
        multi-megabyte tensors per gather cost more than the gather itself on CPU (the
        allocator maps new pages and the kernel zero-fills them), so the groups of a layer
        and all layers of the step share these. Hence one metadata object must not serve
        two paged_attention calls concurrently.
        """
        needed = self.max_gather_blocks if num_blocks is None else num_blocks
        # Buffers made under inference_mode cannot be written outside it, hence the mode in the key.
        key = (key_cache.dtype, key_cache.device, torch.is_inference_mode_enabled(), *key_cache.shape[1:])
        buffers = self._workspace.get(key)
        if buffers is None or buffers[0].shape[0] < needed:
            shape = (needed, *key_cache.shape[1:])
            buffers = (key_cache.new_empty(shape), key_cache.new_empty(shape))
            self._workspace[key] = buffers
        return buffers


def _as_int_array(values: Sequence[int], name: str) -> npt.NDArray[np.int64]:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat list of ints, got shape {arr.shape}")
    return arr


def _padded_block_table(
    block_tables: Sequence[Sequence[int]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Ragged list of block ids -> ([S, max_len] padded with 0, [S] row lengths), no per-entry loop."""
    row_lens = np.fromiter((len(row) for row in block_tables), dtype=np.int64, count=len(block_tables))
    width = int(row_lens.max()) if row_lens.size else 0
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(row_lens.sum()))
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    table[np.arange(width)[None, :] < row_lens[:, None]] = flat
    return table, row_lens


def _decode_groups(
    seqs: npt.NDArray[np.int64],
    seq_lens: npt.NDArray[np.int64],
    token_rows: npt.NDArray[np.int64],
    table: npt.NDArray[np.int64],
    block_size: int,
    device: torch.device,
    max_group_tokens: int,
    max_group_seqs: int,
    min_group_seqs: int,
) -> tuple[DecodeGroup, ...]:
    if seqs.size == 0:
        return ()
    # Longest first, so each group's first member sets its padded width.
    order = seqs[np.argsort(-seq_lens[seqs], kind="stable")]
    # A plain list: the loop below indexes it per sequence, and numpy scalar access is slow.
    nblocks: list[int] = ((seq_lens[order] + block_size - 1) // block_size).tolist()
    groups: list[DecodeGroup] = []
    i = 0
    n_dec = order.size
    while i < n_dec:
        width = nblocks[i]
        cap = min(max_group_seqs, max(min_group_seqs, max_group_tokens // (width * block_size)))
        min_blocks = width * (1.0 - DECODE_GROUP_MAX_PAD_FRACTION)
        j = i + 1
        while j < n_dec and j - i < cap and nblocks[j] >= min_blocks:
            j += 1
        members = order[i:j]
        n = members.size
        block_ids = np.ascontiguousarray(table[members, :width]).reshape(-1)
        key_mask = np.arange(width * block_size)[None, :] < seq_lens[members][:, None]
        pad_rows = np.flatnonzero(~key_mask)
        groups.append(
            DecodeGroup(
                token_indices=torch.from_numpy(np.ascontiguousarray(token_rows[members])).to(device),
                block_ids=torch.from_numpy(block_ids).to(device),
                key_mask=torch.from_numpy(key_mask).view(n, 1, 1, width * block_size).to(device),
                pad_rows=torch.from_numpy(pad_rows).to(device) if pad_rows.size else None,
                num_seqs=n,
                max_blocks=width,
            )
        )
        i = j
    return tuple(groups)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    *,
    decode_group_max_tokens: int = DECODE_GROUP_MAX_TOKENS,
    decode_group_max_seqs: int = DECODE_GROUP_MAX_SEQS,
    decode_group_min_seqs: int | None = None,
) -> AttentionMetadata:
    """Precompute everything the step's layers share. Raises ValueError on inconsistent input.

    block_tables[s] lists sequence s's physical blocks in logical order; it must cover
    ceil(seq_lens[s] / block_size) blocks (extra trailing entries are allowed and ignored).
    The keyword arguments tune decode grouping and are for benchmarks; the minimum group
    size defaults to torch's intra-op thread count (capped by the maximum).
    """
    device = torch.device(device)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    q_lens = _as_int_array(query_lens, "query_lens")
    s_lens = _as_int_array(seq_lens, "seq_lens")
    num_seqs = q_lens.size
    if s_lens.size != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(
            f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
            f"{num_seqs}, {s_lens.size} and {len(block_tables)}"
        )
    if num_seqs and int(q_lens.min()) < 1:
        raise ValueError(f"every query_len must be >= 1, got {q_lens.tolist()}")
    if np.any(s_lens < q_lens):
        raise ValueError(f"seq_lens must be >= query_lens, got seq_lens={s_lens.tolist()}")
    table, row_lens = _padded_block_table(block_tables)
    needed = (s_lens + block_size - 1) // block_size
    if np.any(row_lens < needed):
        bad = int(np.argmax(row_lens < needed))
        raise ValueError(
            f"block_tables[{bad}] has {int(row_lens[bad])} blocks but seq_len {int(s_lens[bad])} "
            f"needs {int(needed[bad])} at block_size {block_size}"
        )
    if table.size and int(table.min()) < 0:
        raise ValueError("block ids must be non-negative")

    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])

    # Position of every new token within its sequence, then its slot, all vectorised.
    token_seq = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - query_start[token_seq] + (s_lens - q_lens)[token_seq]
    slots = table[token_seq, positions // block_size] * block_size + positions % block_size
    if np.unique(slots).size != num_tokens:
        # Two tokens written to one slot means a shared block is being written: the cache
        # manager failed to copy-on-write. index_copy_ would silently keep one of them.
        raise ValueError("slot_mapping has duplicate slots: two new tokens map to the same cache slot")

    is_decode = q_lens == 1
    decode_seqs = np.flatnonzero(is_decode)
    group_spec = _DecodeGroupSpec(
        seqs=decode_seqs,
        seq_lens=s_lens,
        token_rows=query_start[:-1],
        table=table,
        max_group_tokens=decode_group_max_tokens,
        max_group_seqs=decode_group_max_seqs,
        min_group_seqs=min(decode_group_max_seqs, torch.get_num_threads())
        if decode_group_min_seqs is None
        else decode_group_min_seqs,
    )
    # Longest first; stable, so equal lengths keep batch order.
    decode_order = decode_seqs[np.argsort(-s_lens[decode_seqs], kind="stable")]
    decode_width = int(needed[decode_order].max()) if decode_order.size else 0
    prefill_seqs = np.flatnonzero(~is_decode)
    prefill_width = int(needed[prefill_seqs].max()) if prefill_seqs.size else 0
    prefills: list[PrefillSeq] = []
    for s in prefill_seqs.tolist():
        start = int(query_start[s])
        prefills.append(
            PrefillSeq(
                token_start=start,
                token_end=start + int(q_lens[s]),
                seq_len=int(s_lens[s]),
                block_ids=torch.from_numpy(np.ascontiguousarray(table[s, : int(needed[s])])).to(device),
            )
        )

    return AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        block_size=block_size,
        max_query_len=int(q_lens.max()) if num_seqs else 0,
        max_seq_len=int(s_lens.max()) if num_seqs else 0,
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(s_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(table.astype(np.int32)).to(device),
        prefills=tuple(prefills),
        num_decode_tokens=int(decode_seqs.size),
        decode_block_tables=torch.from_numpy(
            np.ascontiguousarray(table[decode_order, :decode_width], dtype=np.int32)
        ).to(device),
        decode_seq_lens=torch.from_numpy(s_lens[decode_order].astype(np.int32)).to(device),
        decode_token_rows=torch.from_numpy(query_start[decode_order]).to(device),
        prefill_block_tables=torch.from_numpy(
            np.ascontiguousarray(table[prefill_seqs, :prefill_width], dtype=np.int32)
        ).to(device),
        prefill_seq_lens=torch.from_numpy(s_lens[prefill_seqs].astype(np.int32)).to(device),
        prefill_query_lens=torch.from_numpy(q_lens[prefill_seqs].astype(np.int32)).to(device),
        prefill_query_starts=torch.from_numpy(query_start[prefill_seqs]).to(device),
        max_prefill_blocks=prefill_width,
        _decode_group_spec=group_spec,
        _host=_HostBatch(q_lens, s_lens, query_start, decode_order),
    )
