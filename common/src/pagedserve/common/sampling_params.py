"""Per-request sampling parameters, validated at construction. Imports no torch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedserve.common.constraints import Constraint
from pagedserve.common.invalid_field import InvalidField

__all__ = ["InvalidField", "SamplingParams"]

MAX_NUM_SAMPLES = 128
"""The most completions one prompt may ask for (`n`, and `best_of`): each costs its own KV
blocks, engine sequence and detokenizer, so one request cannot ask for unbounded work."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""The most token ids one request may bias (OpenAI's limit)."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)."""
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
"""The most stop token ids one request may name: the scheduler checks every sampled token
against them, per sample and step, so an unbounded list (millions are legal JSON) would hold
the engine thread for everyone; the model's own end-of-sequence ids come on top."""
MAX_ALLOWED_TOKEN_IDS = MAX_STOP_TOKEN_IDS
"""The most ids `allowed_token_ids` may name (the sampler builds a mask of them per step)."""
MAX_BAD_WORDS_TOKEN_IDS = 4096
"""The most token ids all of `bad_words_token_ids` may hold together: the sampler compares the
output's tail with each word's prefix per sample and step."""
MIN_SAMPLING_TEMPERATURE = 0.01
"""A sampled request's lowest temperature: a positive temperature below it samples at it (as
vLLM does). Dividing logits by a tinier one (1e-45 is a valid float32) overflows them to
infinity and the sampler's probabilities to NaN; at 0.01 sampling is all but greedy anyway."""
MIN_REPETITION_PENALTY = 0.01
"""The lowest repetition penalty applied: a positive one below it is applied as it, for the
same reason (the penalty divides the logits of seen tokens)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Names follow vLLM's SamplingParams.

    `temperature == 0` means greedy; a positive temperature below MIN_SAMPLING_TEMPERATURE
    (and a repetition penalty below MIN_REPETITION_PENALTY) is raised to it, so no valid value
    can make the sampler's arithmetic overflow. `seed` makes a sampled request reproducible on its own,
    whatever else shares its batch. `logit_bias` (token id -> bias, a mapping or pairs) is
    added to the logits before sampling; it is kept as sorted (id, bias) pairs. Invalid values
    raise `InvalidField` (a ValueError) naming the field. `constraint` (structured outputs,
    pagedserve.common.constraints) makes every completion match a schema, regex, choice or
    grammar. `min_tokens` (<= max_tokens) masks EOS and the stop token ids until that many
    tokens were generated; `allowed_token_ids` (non-empty) masks every other token;
    `bad_words_token_ids`: token sequences never generated (vLLM's bad_words, tokenized).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # completions generated; the n with the best cumulative logprob return
    logprobs: int | None = None  # per generated token: its logprob plus this many top alternatives
    # Per prompt token after the first: its logprob given its prefix plus this many top alternatives.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL/HF semantics, over prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    constraint: Constraint | None = None  # structured output: what every completion must match
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens were generated
    allowed_token_ids: tuple[int, ...] | None = None  # when set, every other token is masked
    # Token sequences never generated: a word's last token is masked after the rest of it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # False: never draft for this request, even when the server runs speculative decoding.
    speculative: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.speculative, bool):
            raise InvalidField("speculative", f"must be a boolean, got {self.speculative!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidField("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise InvalidField(name, f"must be a number, got {getattr(self, name)!r}")
        if not _is_number(self.repetition_penalty):
            raise InvalidField("repetition_penalty", f"must be a number, got {self.repetition_penalty!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidField("temperature", f"must be >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise InvalidField("temperature", f"must be finite, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidField("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidField("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidField("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InvalidField("seed", f"must be a non-negative integer, got {self.seed!r}")
        for name in ("n", "best_of", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None and name != "n":
                continue
            counts_logprobs = name in ("logprobs", "prompt_logprobs")
            low = 0 if counts_logprobs else 1
            if not _is_int(value) or value < low:
                raise InvalidField(name, f"must be an integer >= {low}, got {value!r}")
            top = MAX_LOGPROBS if counts_logprobs else MAX_NUM_SAMPLES
            if value > top:
                raise InvalidField(name, f"must be at most {top}, got {value}")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidField("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidField(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidField("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if 0.0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_SAMPLING_TEMPERATURE)
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            object.__setattr__(self, "repetition_penalty", MIN_REPETITION_PENALTY)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidField("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        stop_ids = tuple(self.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidField(
                "stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop_ids)}"
            )
        if any(not _is_int(t) or t < 0 for t in stop_ids):
            shown = repr(self.stop_token_ids) if len(stop_ids) <= 8 else f"{list(stop_ids[:8])!r}..."
            raise InvalidField("stop_token_ids", f"must be non-negative integers, got {shown}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidField(
                "min_tokens",
                f"must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}",
            )
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _allowed_token_ids(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", _bad_words(self.bad_words_token_ids))
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidField(
                    "constraint", f"must be a Constraint, got {type(self.constraint).__name__}"
                )
            if self.ignore_eos:
                # A finished grammar allows only EOS; generating past it has no constrained meaning.
                raise InvalidField(
                    "ignore_eos", f"cannot be combined with a {self.constraint.kind} constraint"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logprobs(self) -> bool:
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_masks(self) -> bool:
        """Whether the sampler masks tokens for it (allowed_token_ids, min_tokens)."""
        return self.allowed_token_ids is not None or self.min_tokens > 0 or bool(self.bad_words_token_ids)

    @property
    def needs_history(self) -> bool:
        """Whether the sampler reads its token history (penalties; min_tokens counts outputs,
        bad words compare its tail)."""
        return self.has_penalties or self.min_tokens > 0 or bool(self.bad_words_token_ids)


def _allowed_token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise InvalidField("allowed_token_ids", f"must be a list of token ids, got {type(value).__name__}")
    if not value or len(value) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidField(
            "allowed_token_ids", f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(value)}"
        )
    bad = [t for t in value if not _is_int(t) or t < 0]
    if bad:
        raise InvalidField("allowed_token_ids", f"must be non-negative integers, got {bad[:5]!r}")
    return tuple(sorted(set(value)))


def _bad_words(value: object) -> tuple[tuple[int, ...], ...]:
    name = "bad_words_token_ids"
    if not isinstance(value, list | tuple) or any(not isinstance(w, list | tuple) for w in value):
        raise InvalidField(name, "must be a list of token id sequences")
    total = sum(len(w) for w in value)
    if total > MAX_BAD_WORDS_TOKEN_IDS:
        raise InvalidField(name, f"must hold at most {MAX_BAD_WORDS_TOKEN_IDS} token ids in all, got {total}")
    if any(not w for w in value) or any(not _is_int(t) or t < 0 for w in value for t in w):
        raise InvalidField(name, "must be non-empty sequences of non-negative token ids")
    return tuple(tuple(w) for w in value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A logit bias (a mapping or (id, bias) pairs) as sorted pairs; raises InvalidField."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise InvalidField("logit_bias", "must map token ids to biases")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField(
            "logit_bias", f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(pairs)}"
        )
    out: dict[int, float] = {}
    for token, bias in pairs:
        if not _is_int(token) or token < 0:
            raise InvalidField("logit_bias", f"keys must be non-negative token ids, got {token!r}")
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
            raise InvalidField(
                "logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))
