"""The error a bad client-set value raises, naming its field. Imports nothing of ours."""

from __future__ import annotations


class InvalidField(ValueError):
    """A sampling parameter out of range: `field` (as SamplingParams names it) and the reason.
    The message reads "<field> <reason>", e.g. "top_p must be in (0, 1], got 1.5"."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} {reason}")
        self.field = name
        self.reason = reason
