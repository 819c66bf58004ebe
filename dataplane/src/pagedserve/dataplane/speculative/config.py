"""`--speculative-config`: vLLM's JSON shape, validated once. Imports no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup: the continuation of the latest earlier occurrence of
    the sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`) or
    "suffix" (the most frequent continuation of the longest matching suffix, over this request
    and recent requests' outputs, while its share is at least `suffix_min_probability`).
    `num_speculative_tokens`: the most tokens drafted per sequence and step. `adaptive`: verify
    only the drafts that pay for their rows (policy.py); false verifies every draft."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_min_probability: float = 0.1
    suffix_cache_requests: int = 64
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        p = self.suffix_min_probability
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative_config.suffix_min_probability must be in [0, 1], got {p!r}")
        _check_int("suffix_cache_requests", self.suffix_cache_requests, 0, 100_000)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config from its JSON text; ValueError naming the field that is wrong."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"speculative_config is not valid JSON: {exc.msg} at position {exc.pos}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "method" not in data:
            raise ValueError(
                f"speculative_config.method is required (one of {', '.join(SPECULATIVE_METHODS)})"
            )
        return cls(**data)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
