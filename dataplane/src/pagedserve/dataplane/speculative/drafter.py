"""The drafter interface: what a model-free drafter (n-gram, suffix) implements, and what a
draft model or MTP heads would implement to join them. Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    """Proposes tokens to follow a sequence; the engine verifies them in one forward.

    A draft model (same tokenizer) fits the same interface: `propose` runs it for `k` steps
    over the request's tokens (its own small KV cache keyed by `request_id`); MTP heads
    would instead read the target model's last hidden state, which this interface would then
    pass in. Only proposals change; verification, acceptance and KV rollback stay as they are.
    """

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (all of the request's, prompt first)."""
        ...

    def finished(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: drop its state (a drafter learning across requests keeps its output)."""
        ...
