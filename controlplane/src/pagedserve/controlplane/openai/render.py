"""The values of OpenAI's response bodies that are computed, not copied: logprobs (floored,
JSON has no infinity), finish reasons, usage, and the request fields read into ours."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request

from pagedserve.controlplane.errors import clip, invalid_argument
from pagedserve.controlplane.frontend import CompletionDone
from pagedserve.controlplane.openai.protocol import ChatCompletionRequest, CompletionRequest

MIN_LOGPROB = -9999.0
"""What a logprob of -inf is reported as (vLLM's floor): a token a structured output's grammar
masks has probability 0, and JSON has no infinity."""


def floored_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def logit_bias_by_id(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys are strings) keyed by token id; values are checked with
    the other sampling fields."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key.strip()
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise invalid_argument(f"logit_bias keys must be token ids, got {clip(key, 16)!r}", "logit_bias")
        out[int(token)] = value
    return out


def num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def response_id(http: Request) -> str:
    """The response's id: the client's x-request-id if it sent one (validated with the
    request), else a fresh one; never the server's internal request id."""
    return http.headers.get("x-request-id") or uuid.uuid4().hex


def openai_finish(done: CompletionDone) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def openai_usage(done: list[CompletionDone], n: int) -> dict[str, Any]:
    """OpenAI usage: prompt (and cached) tokens count once per prompt, not once per sample."""
    first_of_prompt: dict[int, CompletionDone] = {}
    for d in done:
        first_of_prompt.setdefault(d.index // n, d)
    prompt = sum(d.prompt_tokens for d in first_of_prompt.values())
    completion = sum(d.completion_tokens for d in done)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in first_of_prompt.values())},
    }
    drafted = sum(d.spec_draft_tokens for d in done)
    if drafted:  # speculative decoding ran: OpenAI's predicted-output counts say how it went
        accepted = sum(d.spec_accepted_tokens for d in done)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def sampling_fields(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> dict[str, object]:
    """The sampling fields the body sets, named as SamplingParams names them (for
    `Frontend.validate`, which range-checks them; an unset max_tokens means the rest of
    the context). Only what JSON cannot say directly is converted here: logit_bias keys."""
    values: dict[str, object] = {
        "n": body.num_choices,
        "ignore_eos": bool(body.ignore_eos),
        "stop_token_ids": tuple(body.stop_token_ids or ()),
    }
    for name in (
        "temperature",
        "top_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "speculative",
    ):
        value = getattr(body, name)
        if value is not None:
            values[name] = value
    if body.allowed_token_ids is not None:
        values["allowed_token_ids"] = tuple(body.allowed_token_ids)
    if body.logit_bias:
        values["logit_bias"] = logit_bias_by_id(body.logit_bias)
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if logprobs is not None:
        values["logprobs"] = logprobs
    if body.prompt_logprobs is not None:
        values["prompt_logprobs"] = body.prompt_logprobs
    return values
