"""Suffix drafting: the most frequent continuation of the sequence's longest matching suffix,
counted over this request's own tokens and over recent requests' outputs (after Oliaro et al.,
"SuffixDecoding", 2024, with bounded-depth context counts in place of suffix trees). A draft
grows token by token while the product of the chosen continuations' shares stays at least
`min_probability`. Imports no torch.

Memory is bounded: a request's table holds at most `depth` contexts per token of it, and the
shared table the outputs of the last `cache_requests` finished requests (older ones' counts
are subtracted as they leave).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

Counts = dict[tuple[int, ...], dict[int, int]]


def _add(table: Counts, tokens: Sequence[int], start: int, stop: int, depth: int, sign: int) -> None:
    """Count, for each position p in [start, stop), the token at p after each of its contexts
    of 1..depth tokens."""
    for p in range(max(start, 1), stop):
        nxt = tokens[p]
        for n in range(1, min(depth, p) + 1):
            key = tuple(tokens[p - n : p])
            counts = table.get(key)
            if counts is None:
                if sign < 0:
                    continue
                counts = table[key] = {}
            left = counts.get(nxt, 0) + sign
            if left > 0:
                counts[nxt] = left
            else:
                counts.pop(nxt, None)
                if not counts:
                    del table[key]


class SuffixDrafter:
    def __init__(self, depth: int, min_probability: float, cache_requests: int) -> None:
        self.depth = depth
        self.min_probability = min_probability
        self.cache_requests = cache_requests
        self._own: dict[str, tuple[Counts, list[int]]] = {}  # request -> (table, [indexed])
        self._shared: Counts = {}
        self._recent: deque[list[int]] = deque()

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        own = self._own.get(request_id)
        if own is None:
            own = self._own[request_id] = ({}, [0])
        table, indexed = own
        _add(table, tokens, indexed[0], len(tokens), self.depth, +1)
        indexed[0] = len(tokens)
        tail = list(tokens[-self.depth :])
        draft: list[int] = []
        chance = 1.0
        while len(draft) < k:
            best = self._continuation(table, tail)
            if best is None:
                break
            token, share = best
            chance *= share
            if chance < self.min_probability:
                break
            draft.append(token)
            tail = [*tail, token][-self.depth :]
        return draft

    def _continuation(self, table: Counts, tail: list[int]) -> tuple[int, float] | None:
        """The most frequent next token after the longest suffix of `tail` either table has
        seen, and its share of that suffix's continuations."""
        for n in range(min(self.depth, len(tail)), 0, -1):
            key = tuple(tail[-n:])
            own, shared = table.get(key), self._shared.get(key)
            if not own and not shared:
                continue
            merged = dict(shared or {})
            for token, count in (own or {}).items():
                merged[token] = merged.get(token, 0) + count
            token = max(merged, key=lambda t: (merged[t], -t))
            return token, merged[token] / sum(merged.values())
        return None

    def finished(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        self._own.pop(request_id, None)
        if self.cache_requests == 0:
            return
        output = list(tokens[num_prompt_tokens:])
        _add(self._shared, output, 0, len(output), self.depth, +1)
        self._recent.append(output)
        while len(self._recent) > self.cache_requests:
            old = self._recent.popleft()
            _add(self._shared, old, 0, len(old), self.depth, -1)
