"""Running a chat request's generations for every HTTP API that speaks chat: the OpenAI chat
and completions routes, and the APIs translated onto them (Anthropic's Messages, OpenAI's
Responses). One engine path: each of them builds `GenerationRequest`s the same way and reads
the same `StreamEvent`s; only the rendering differs.

- `merged_events`: the events of several prompts' streams as one, choice index = prompt index
  × n + sample;
- `opened`: the first event of a stream about to be sent (so an admission error still gets a
  status code), or None once the client has left;
- `collected`: every event of an unstreamed answer, by choice, or None once the client has
  left (its request is aborted, its blocks freed);
- `named_sse`: a server-sent-events body of named events (`event: X` / `data: {...}`), the
  framing of Anthropic's and the Responses API's streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedserve.common.telemetry import extract
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import CompletionDone, Frontend, StreamEvent, TextDelta
from pagedserve.controlplane.openai.streaming import first_event, unless_disconnected
from pagedserve.controlplane.openai.tool_calls import ChoiceOutput
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.protos.pagedserve.v1 import common_pb2

SseEvent = tuple[str, dict[str, Any]]
"""One named server-sent event: (its `event:` name, its JSON `data`)."""


@dataclass
class Choice:
    """What one choice of an unstreamed answer generated."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.PromptTokenLogprob] = field(default_factory=list)
    done: CompletionDone | None = None


async def merged_events(
    frontend: Frontend, gens: Sequence[GenerationRequest], n: int, http: Request
) -> AsyncGenerator[StreamEvent, None]:
    """Events of several prompts' streams, choice index = prompt index × n + sample."""
    parent = extract(http.headers.items())
    if len(gens) == 1:
        async for event in frontend.stream(gens[0], parent=parent):
            yield event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: GenerationRequest) -> None:
        try:
            async for event in frontend.stream(gen, parent=parent):
                await queue.put((i, event))
            await queue.put((i, None))
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield dataclasses.replace(item, index=i * n + item.index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def opened(
    http: Request, events: AsyncGenerator[StreamEvent, None]
) -> tuple[StreamEvent | None] | None:
    """The stream's first event (None inside: it had none), waited for before the response
    starts so that admission errors still get a status; None when the client left first
    (`events` is closed then, its request cancelled)."""

    async def first() -> tuple[StreamEvent | None]:
        return (await first_event(events),)

    got = await unless_disconnected(http, first())
    if got is None:
        await events.aclose()
    return got


async def collected(http: Request, events: AsyncGenerator[StreamEvent, None]) -> dict[int, Choice] | None:
    """Every choice of an unstreamed answer, by index in order; None when the client left
    before the end (the request is aborted then). Raises the stream's ServiceError."""
    choices: dict[int, Choice] = {}
    finished = False

    async def collect() -> None:
        nonlocal finished
        async with contextlib.aclosing(events):
            async for event in events:
                c = choices.setdefault(event.index, Choice())
                if isinstance(event, TextDelta):
                    c.text.append(event.text)
                    c.token_ids.extend(event.token_ids)
                    c.logprobs.extend(event.logprobs)
                    c.prompt_logprobs.extend(event.prompt_logprobs)
                else:
                    c.done = event
        finished = True

    await unless_disconnected(http, collect())
    return dict(sorted(choices.items())) if finished else None


async def single_answer(
    http: Request, events: AsyncGenerator[StreamEvent, None], frontend: Frontend, output: ChoiceOutput
) -> tuple[dict[str, Any], CompletionDone | None] | None:
    """The message of an unstreamed one-choice answer as `output` reads it, and how it ended;
    None when the client left first. Counts its tool calls."""
    choices = await collected(http, events)
    if choices is None:
        return None
    choice = choices.get(0)
    text = "".join(choice.text) if choice is not None else ""
    message = output.message(0, text)
    if output.calls is not None:
        frontend.metrics.tool_calls.inc(output.calls.num_calls(0))
    return message, choice.done if choice is not None else None


async def named_sse(
    first: StreamEvent | None,
    events: AsyncIterator[StreamEvent],
    render: Callable[[StreamEvent | None], list[SseEvent]],
    render_error: Callable[[ServiceError], list[SseEvent]],
) -> AsyncIterator[str]:
    """The SSE body of named events: `render(event)` for each event, then `render(None)` for
    the closing events; a ServiceError after the headers went out is `render_error`'s events,
    and ends the stream."""
    try:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            pending = [first] if first is not None else []
            while True:
                if pending:
                    event = pending.pop()
                else:
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        break
                for name, data in render(event):
                    yield _frame(name, data)
    except ServiceError as exc:
        for name, data in render_error(exc):
            yield _frame(name, data)
        return
    for name, data in render(None):
        yield _frame(name, data)


def _frame(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
