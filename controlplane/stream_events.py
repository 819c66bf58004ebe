"""The events of one request's stream (`Frontend.stream`): text deltas and one `CompletionDone`
per completion index."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.protos.pagedserve.v1 import common_pb2


@dataclass(frozen=True)
class TextDelta:
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    # sampling_params.prompt_logprobs: on completion 0's first delta, one per prompt token after the first
    prompt_logprobs: tuple[common_pb2.PromptTokenLogprob, ...] = ()


@dataclass(frozen=True)
class CompletionDone:
    index: int
    finish_reason: str  # "stop" | "length" | "abort"
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    e2e_seconds: float


StreamEvent = TextDelta | CompletionDone
