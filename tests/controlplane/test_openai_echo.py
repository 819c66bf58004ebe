"""The echo helpers of the OpenAI routes: a prompt-only request's events (its token dropped, its
prompt logprobs kept, its end a length unless aborted) and the legacy logprobs object with the
prompt first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from pagedserve.controlplane.frontend import CompletionDone, StreamEvent, TextDelta
from pagedserve.controlplane.openai.echo import legacy_logprobs, prompt_only, vllm_prompt_logprobs
from pagedserve.protos.pagedserve.v1 import common_pb2

ENTRY = common_pb2.PromptTokenLogprob(
    logprob=-1.5, rank=2, top=[common_pb2.TopLogprob(token_id=9, logprob=-0.5)]
)


def done(index: int, reason: str, stop_string: str | None = None) -> CompletionDone:
    return CompletionDone(index, reason, stop_string, 3, 1, 0, 0.0, 0.0, 0.0)


def test_prompt_only_drops_the_token_and_reports_none() -> None:
    async def events() -> AsyncGenerator[StreamEvent, None]:
        yield TextDelta(0, (7,), "x", (common_pb2.TokenLogprob(logprob=-0.1),), (ENTRY, ENTRY))
        yield done(0, "stop", "x")
        yield TextDelta(1, (8,), "y")
        yield done(1, "abort")

    async def run() -> list[StreamEvent]:
        return [e async for e in prompt_only(events())]

    first, end, second, aborted = asyncio.run(run())
    assert first == TextDelta(0, (), "", (), (ENTRY, ENTRY))
    assert second == TextDelta(1, (), "")
    assert isinstance(end, CompletionDone) and isinstance(aborted, CompletionDone)
    assert (end.finish_reason, end.stop_string, end.completion_tokens) == ("length", None, 0)
    assert (aborted.finish_reason, aborted.completion_tokens) == ("abort", 0)


def test_legacy_logprobs_put_the_prompt_first() -> None:
    def decode(token: int) -> str:
        return f"<{token}>"

    out = legacy_logprobs(decode, [5], [common_pb2.TokenLogprob(logprob=-0.25)], [1, 2], [ENTRY])
    assert out["tokens"] == ["<1>", "<2>", "<5>"]
    assert out["token_logprobs"] == [None, -1.5, -0.25]
    assert out["top_logprobs"] == [None, {"<9>": -0.5, "<2>": -1.5}, {}]
    assert out["text_offset"] == [0, 3, 6]
    assert vllm_prompt_logprobs(decode, [1, 2], [ENTRY]) == [
        None,
        {
            9: {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
            2: {"logprob": -1.5, "rank": 2, "decoded_token": "<2>"},
        },
    ]
