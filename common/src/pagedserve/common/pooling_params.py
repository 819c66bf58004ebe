"""How a pooling (embedding) request turns its prompt's hidden states into one vector. No torch.

A pooling request is prompt-only: the engine computes its prompt (in chunks, like any
prefill), pools the final-layer hidden states (after the model's final norm) and frees its KV
blocks; nothing is sampled. Names follow vLLM's pooler: `last` (the last token: causal
embedding models such as Qwen3-Embedding, e5-mistral, gte-Qwen2), `mean` (over every prompt
token) and `cls` (the first token), each L2-normalised unless `normalize` is off.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.invalid_field import InvalidField

POOLING_TYPES = ("last", "mean", "cls")
DEFAULT_POOLING_TYPE = "last"


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = DEFAULT_POOLING_TYPE
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidField(
                "pooling_type",
                f"must be one of {', '.join(POOLING_TYPES)}, got {str(self.pooling_type)[:32]!r}",
            )
        if not isinstance(self.normalize, bool):
            raise InvalidField("normalize", f"must be a boolean, got {str(self.normalize)[:32]!r}")

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt position must be computed for this request (so a cached prefix
        may not stand in for them): mean pools all rows and cls the first; last needs only the
        final row, which is always computed (the prefix cache leaves at least one token)."""
        return self.pooling_type != "last"
