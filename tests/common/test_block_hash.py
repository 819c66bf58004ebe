"""The block-hash encoding: fixed test vectors (the same as docs/prefix-hash.md) and its edges."""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import pytest

from pagedserve.common.block_hash import (
    HASH_VERSION_TAG,
    BlockHash,
    BlockKey,
    block_keys,
    first_block_extra_keys,
    hash_block_tokens,
    hash_request_blocks,
    seed_hash,
)

ROOT = "3addc67b506773b87f842ffcdc5d684d9c3f9cda0d80db1ba1cc2a187e94c501"
V1 = "dfc0ceea0437935b772022759a190c2945353ea2d3c49b96a63fef76f967fc6f"
V2 = "cf4e52124d8ace9b642b8755c0b50a3eeea34fab4e4346286987085e3a1be5cc"
V3 = "e62e62236e12871f670944d177cb70dc967d33e35b0a0e52ee70a3d29566b951"
ROOT_MY_CLUSTER = "4cbfcec96cb0c037dac411b0f4d4a1bfe9eeda94a8dc33eab1723a12496531e3"
V4 = "33342dc2f1db7ed75341a021be0165f560af0334062d6e1f1b9e70a4722fc7c4"
REQUEST_NO_SALT = [
    "8f0a8dfe6cf652a142aa3fd24bf4af84369b2e95746a8c20c0a444e524ee3f7c",
    "432e12a8b705326c1c276db4ef93c8f5d5d12469c30afa672e09c0da6e987f63",
]
REQUEST_SALT_A = [
    "8d22c3e7000dd9b89e79182e5b24b61dc761711e356a657853dbe7a971b5a966",
    "96524589bf7f57a66ba9dfe275ef6dad179eeb90d578ebcf533cd4b3bdcac948",
]
V1_MESSAGE = (
    "706167656473657276652d626c6f636b2d7631"
    "3addc67b506773b87f842ffcdc5d684d9c3f9cda0d80db1ba1cc2a187e94c501"
    "04000000"
    "01000000020000000300000004000000"
    "00000000"
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "prefix-hash.md"


def test_vectors() -> None:
    root = seed_hash("pagedserve")
    assert root.hex() == ROOT
    v1 = hash_block_tokens(root, [1, 2, 3, 4])
    assert v1.hex() == V1
    assert hash_block_tokens(v1, [5, 6, 7, 8]).hex() == V2
    assert hash_block_tokens(root, [1, 2, 3, 4], ["salt:tenant-a"]).hex() == V3
    other = seed_hash("my-cluster")
    assert other.hex() == ROOT_MY_CLUSTER
    v4 = hash_block_tokens(other, [0, 49151, 2**32 - 1, 7], ["salt:é", "adapter:sql-lora"])
    assert v4.hex() == V4


def test_request_vectors() -> None:
    tokens = list(range(10))
    assert [h.hex() for h in hash_request_blocks(tokens, 4, "pagedserve")] == REQUEST_NO_SALT
    salted = hash_request_blocks(tokens, 4, "pagedserve", first_block_extra_keys("tenant-a"))
    assert [h.hex() for h in salted] == REQUEST_SALT_A


def test_the_documented_message_bytes_hash_to_vector_1() -> None:
    """The encoding written out by hand, independent of hash_block_tokens."""
    message = bytes.fromhex(V1_MESSAGE)
    assert len(message) == 75
    assert message.startswith(HASH_VERSION_TAG)
    assert hashlib.sha256(message).hexdigest() == V1
    salted = bytes.fromhex(V1_MESSAGE[:-8]) + struct.pack("<II", 1, 13) + b"salt:tenant-a"
    assert len(salted) == 92
    assert hashlib.sha256(salted).hexdigest() == V3


def test_the_doc_lists_the_same_vectors() -> None:
    text = DOC.read_text(encoding="utf-8")
    documented = set(re.findall(r"\b[0-9a-f]{64}\b", text))
    assert {ROOT, V1, V2, V3, ROOT_MY_CLUSTER, V4, *REQUEST_NO_SALT, *REQUEST_SALT_A} <= documented
    assert V1_MESSAGE[:38] in text.replace(" ", "")


def test_only_full_blocks_are_hashed_and_chained() -> None:
    root = seed_hash("s")
    assert hash_request_blocks([1, 2, 3], 4, "s") == []
    one, two = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "s")
    assert one == hash_block_tokens(root, [1, 2, 3, 4])
    assert two == hash_block_tokens(one, [5, 6, 7, 8])
    # The salt goes into the first block only; the chain carries it on.
    s1, s2 = hash_request_blocks(list(range(1, 9)), 4, "s", ["salt:x"])
    assert s1 == hash_block_tokens(root, [1, 2, 3, 4], ["salt:x"])
    assert s2 == hash_block_tokens(s1, [5, 6, 7, 8])
    assert s2 != two


def test_block_keys_extend_incrementally() -> None:
    root = seed_hash("pagedserve")
    tokens = list(range(13))
    full = block_keys(tokens, 4, root, ["salt:a"])
    assert [k.digest() for k, _ in full] == [h for _, h in full]
    assert full[0][0] == BlockKey(root, (0, 1, 2, 3), ("salt:a",))
    assert full[1][0] == BlockKey(full[0][1], (4, 5, 6, 7), ())
    known = [full[0][1]]
    assert block_keys(tokens, 4, root, ["salt:a"], known) == full[1:]
    assert block_keys(tokens, 4, root, ["salt:a"], [h for _, h in full]) == []


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # Each field is length-prefixed, so shifting bytes between fields changes the hash.
        (([1, 2], ["ab"]), ([1, 2], ["a", "b"])),
        (([1, 2], []), ([1, 2], [""])),
        (([1], []), ([1, 0], [])),
        (([256], []), ([1, 1], [])),
    ],
)
def test_distinct_inputs_give_distinct_hashes(
    a: tuple[list[int], list[str]], b: tuple[list[int], list[str]]
) -> None:
    root = seed_hash("pagedserve")
    assert hash_block_tokens(root, *a) != hash_block_tokens(root, *b)


def test_seed_separates_hashes() -> None:
    assert hash_request_blocks([1, 2], 2, "a") != hash_request_blocks([1, 2], 2, "b")


@pytest.mark.parametrize("bad", [-1, 2**32, True, 1.0])
def test_token_ids_must_fit_u32(bad: object) -> None:
    with pytest.raises(ValueError, match="token id"):
        hash_block_tokens(seed_hash("s"), [1, bad])  # type: ignore[list-item]


def test_parent_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block_tokens(BlockHash(b"short"), [1])


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([1], 0, "s")


def test_salt_extra_key() -> None:
    assert first_block_extra_keys(None) == ()
    assert first_block_extra_keys("tenant-a") == ("salt:tenant-a",)
