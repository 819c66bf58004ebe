"""Streaming and disconnects of the HTTP API: the server-sent-events body (`data: {chunk}` ...
`data: [DONE]`, with a usage chunk on request) and a client's disconnect cancelling its work
(out of the admission queue, or aborting it on the data plane so its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import CompletionDone, StreamEvent
from pagedserve.controlplane.openai.errors import error_body

T = TypeVar("T")


async def until_disconnected(http: Request) -> None:
    """Returns when the client has gone away. The body has been read by then, so the only
    message left to receive is the disconnect (a request's own cancellation ends it too)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (with `work` cancelled) as soon as the client disconnects:
    a request waiting in the admission queue leaves it at once, one running is aborted."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(until_disconnected(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client left (or this handler is being cancelled)
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()  # re-raises a ServiceError


async def first_event(events: AsyncIterator[StreamEvent]) -> StreamEvent | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def sse_body(
    first: StreamEvent | None,
    events: AsyncIterator[StreamEvent],
    render: Any,
    render_usage: Any,
    running_prompt_tokens: int | None = None,
) -> AsyncIterator[str]:
    """The SSE body. With `running_prompt_tokens` (continuous usage stats) every chunk also
    carries the response's usage so far: all its prompts' tokens and every choice's completion
    tokens streamed until then; the final usage chunk stays the exact total."""
    done: list[CompletionDone] = []
    completion_tokens = 0
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
                if isinstance(event, CompletionDone):
                    done.append(event)
                else:
                    completion_tokens += len(event.token_ids)
                rendered = render(event)
                if rendered is None:  # nothing to send for this event (held back)
                    continue
                if running_prompt_tokens is not None:
                    rendered["usage"] = {
                        "prompt_tokens": running_prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": running_prompt_tokens + completion_tokens,
                    }
                yield f"data: {json.dumps(rendered)}\n\n"
    except ServiceError as exc:  # after the headers went out: report it in the stream
        error = error_body(exc.http_status, exc.message, exc.param, exc.code.lower())
        yield f"data: {json.dumps(error)}\n\n"
    if render_usage is not None:
        yield f"data: {json.dumps(render_usage(done))}\n\n"
    yield "data: [DONE]\n\n"
