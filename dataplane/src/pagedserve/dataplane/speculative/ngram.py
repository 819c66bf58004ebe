"""Prompt-lookup (n-gram) drafting: the continuation of the latest earlier occurrence of the
sequence's last n tokens, for n from `max_n` down to `min_n` (Saxena, "Prompt Lookup
Decoding", 2023; vLLM's `ngram` method). Imports no torch.

Each request keeps an index from every n-gram it has seen to where that n-gram last ended,
extended by the tokens appended since the previous call: a proposal costs O(max_n - min_n)
dictionary look-ups however long the context, and the index holds at most
(max_n - min_n + 1) entries per token of the request.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Index:
    __slots__ = ("ends", "indexed")

    def __init__(self, sizes: range) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at positions 1..indexed are in `ends`


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest match first
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index(self.sizes)
        length = len(tokens)
        # Index the n-grams ending before the last position (the suffix itself is the query).
        for end in range(index.indexed + 1, length):
            for n, ends in index.ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, length - 1)
        for n, ends in index.ends.items():
            if length < n:
                continue
            found = ends.get(tuple(tokens[length - n :]))
            if found is not None:
                return list(tokens[found : found + k])
        return []

    def finished(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(request_id, None)
