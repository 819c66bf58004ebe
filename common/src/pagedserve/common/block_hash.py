"""Chained block hashes for automatic prefix caching. Imports no torch.

A full block's hash is SHA-256 over a canonical byte string (docs/prefix-hash.md): a version
tag, the parent block's hash, the block's token ids and its extra keys. The first block's
parent is SHA-256 of the configured seed. The encoding is fixed so a control plane written
in any language computes the same hashes as the data plane holding the blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""32 raw bytes of SHA-256; `.hex()` for display."""

HASH_VERSION_TAG = b"pagedserve-block-v1"
SALT_KEY_PREFIX = "salt:"

# The hash seed of every chain unless configured (`--prefix-hash-seed`); planes that share an index
# must agree on it.
DEFAULT_HASH_SEED = "pagedserve"

_U32_MAX = 2**32 - 1


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that `a` tokens fill at `b` tokens per block."""
    return -(-a // b)


def seed_hash(seed: str) -> BlockHash:
    """The parent hash of every chain's first block: SHA-256 of the UTF-8 bytes of `seed`."""
    return BlockHash(hashlib.sha256(seed.encode("utf-8")).digest())


def _u32(value: int, what: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise ValueError(f"{what} must be an integer in [0, 2**32), got {value!r}")
    return struct.pack("<I", value)


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """H(parent, token ids, extra keys), byte for byte as docs/prefix-hash.md specifies."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    h = hashlib.sha256(HASH_VERSION_TAG)
    h.update(parent)
    h.update(_u32(len(token_ids), "token count"))
    h.update(b"".join(_u32(t, "token id") for t in token_ids))
    h.update(_u32(len(extra_keys), "extra key count"))
    for key in extra_keys:
        raw = key.encode("utf-8")
        h.update(_u32(len(raw), "extra key length"))
        h.update(raw)
    return BlockHash(h.digest())


def first_block_extra_keys(cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys of a request's first block; chaining carries them into every later block."""
    return () if cache_salt is None else (SALT_KEY_PREFIX + cache_salt,)


@dataclass(frozen=True)
class BlockKey:
    """Everything a block's hash covers. A cached block keeps its key so a hit can be verified
    field by field: equal keys along a chain mean equal prefixes, whatever SHA-256 does."""

    parent: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] = ()

    def digest(self) -> BlockHash:
        return hash_block_tokens(self.parent, self.token_ids, self.extra_keys)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra_keys_first_block: Sequence[str] = (),
    known: Sequence[BlockHash] = (),
) -> list[tuple[BlockKey, BlockHash]]:
    """Keys and hashes of the full blocks of `token_ids` after the `known` leading hashes.

    `root` is `seed_hash(seed)`. Extends a request's hash list incrementally: the token ids
    only grow, so hashes already computed stay valid.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[tuple[BlockKey, BlockHash]] = []
    parent = known[-1] if known else root
    for i in range(len(known), len(token_ids) // block_size):
        extras = tuple(extra_keys_first_block) if i == 0 else ()
        key = BlockKey(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extras)
        parent = key.digest()
        out.append((key, parent))
    return out


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, seed: str, extra_keys_first_block: Sequence[str] = ()
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    return [h for _, h in block_keys(token_ids, block_size, seed_hash(seed), extra_keys_first_block)]
