"""Prompt logprobs and echo on the OpenAI routes: the legacy completions `logprobs` object (with
`echo`, the prompt tokens come first, the first one's logprob `null`), vLLM's `prompt_logprobs`
list, and prompt-only requests (`echo` with `max_tokens: 0`).

A prompt-only request runs with max_tokens 1 and its generated token is dropped here
(`prompt_only`): the prompt's logprobs come from the prefill either way, and its KV blocks are
freed like any finished request's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from pagedserve.controlplane.frontend import StreamEvent, TextDelta
from pagedserve.controlplane.openai.render import floored_logprob
from pagedserve.protos.pagedserve.v1 import common_pb2

Decode = Callable[[int], str]


def legacy_logprobs(
    decode: Decode,
    token_ids: Sequence[int],
    lps: Sequence[common_pb2.TokenLogprob],
    prompt: Sequence[int] = (),
    prompt_lps: Sequence[common_pb2.PromptTokenLogprob] = (),
) -> dict[str, Any]:
    """The completions `logprobs` object of a choice: the `prompt` tokens (echo) with their
    `prompt_lps` (one per prompt token after the first), then the generated ones."""
    tokens = [decode(t) for t in (*prompt, *token_ids)]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    if prompt:
        token_logprobs.append(None)
        top_logprobs.append(None)
        for token, entry in zip(prompt[1:], prompt_lps, strict=False):
            token_logprobs.append(floored_logprob(entry.logprob))
            top = {decode(x.token_id): floored_logprob(x.logprob) for x in entry.top}
            top_logprobs.append({**top, decode(token): floored_logprob(entry.logprob)})
    token_logprobs += [floored_logprob(lp.logprob) for lp in lps]
    top_logprobs += [{decode(t.token_id): floored_logprob(t.logprob) for t in lp.top} for lp in lps]
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    decode: Decode, prompt: Sequence[int], entries: Sequence[common_pb2.PromptTokenLogprob]
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: one entry per prompt token, None for the first, else token id
    -> {logprob, rank, decoded_token} for the prompt token and the top alternatives."""
    out: list[dict[int, dict[str, Any]] | None] = [None]
    for token, entry in zip(prompt[1:], entries, strict=False):
        ranked = {
            x.token_id: {
                "logprob": floored_logprob(x.logprob),
                "rank": rank,
                "decoded_token": decode(x.token_id),
            }
            for rank, x in enumerate(entry.top, start=1)
        }
        ranked[token] = {
            "logprob": floored_logprob(entry.logprob),
            "rank": entry.rank,
            "decoded_token": decode(token),
        }
        out.append(ranked)
    return out


async def prompt_only(events: AsyncGenerator[StreamEvent, None]) -> AsyncGenerator[StreamEvent, None]:
    """The events of a prompt-only request (run with max_tokens 1): its generated token is
    dropped (its prompt logprobs kept), and each completion reports none generated, ended by
    its length."""
    async with contextlib.aclosing(events):  # closing this stream cancels the request
        async for event in events:
            if isinstance(event, TextDelta):
                yield TextDelta(event.index, (), "", (), event.prompt_logprobs)
            else:
                # The one token ran into max_tokens 0 whatever it was (EOS, a stop string);
                # an abort stays one.
                reason = "abort" if event.finish_reason == "abort" else "length"
                yield dataclasses.replace(event, completion_tokens=0, finish_reason=reason, stop_string=None)
