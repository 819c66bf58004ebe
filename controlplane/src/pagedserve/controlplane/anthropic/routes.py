"""`POST /v1/messages`: Anthropic's Messages API, run by the chat-completions path (and
`POST /v1/messages/count_tokens`: the prompt's token count, as Claude Code asks for it).

The body is translated into a chat-completions request (`protocol.py`) and run by
`OpenAIRoutes.chat_run` (the chat template, tool calls, stop strings and sampling checks of
that route, one engine path); only the answer is rendered here (`render.py`). A client that
leaves before its answer starts cancels its request, as on the chat route.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.controlplane.anthropic.protocol import CountTokensRequest, MessagesRequest, translate
from pagedserve.controlplane.anthropic.render import (
    MessageStream,
    content_blocks,
    message_body,
    stop_reason,
    usage,
)
from pagedserve.controlplane.errors import MESSAGES_PATH, ServiceError, anthropic_error_body
from pagedserve.controlplane.frontend import StreamEvent, TextDelta
from pagedserve.controlplane.openai.routes import CLIENT_CLOSED_REQUEST, OpenAIRoutes
from pagedserve.controlplane.openai.running import SseEvent, merged_events, named_sse, opened, single_answer


class AnthropicRoutes:
    def __init__(self, chat: OpenAIRoutes) -> None:
        self.chat = chat
        self.router = APIRouter()
        self.router.add_api_route(MESSAGES_PATH, self.messages, methods=["POST"], response_model=None)
        self.router.add_api_route(MESSAGES_PATH + "/count_tokens", self.count_tokens, methods=["POST"])

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt tokens a Messages request would have (system, tools and template included)."""
        translated = translate(body)
        try:
            prompt, _, _ = self.chat.chat_prompt(translated.chat)
        except ServiceError as exc:
            raise translated.renamed(exc) from None
        return {"input_tokens": len(prompt)}

    async def messages(self, body: MessagesRequest, http: Request) -> Response:
        translated = translate(body)
        try:
            run = self.chat.chat_run(translated.chat, http, {"stop": "stop_sequences"})
        except ServiceError as exc:
            raise translated.renamed(exc) from None
        frontend, calls, output = self.chat.frontend, run.calls, run.output
        rid = f"msg_{http.headers.get('x-request-id') or uuid.uuid4().hex}"
        prompt_tokens = run.gens[0].num_prompt_tokens
        events = merged_events(frontend, run.gens, 1, http)
        if body.stream:
            got = await opened(http, events)
            if got is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            stream = MessageStream(rid, frontend.model_name, prompt_tokens)
            started = False

            def render(event: StreamEvent | None) -> list[SseEvent]:
                nonlocal started
                out = [] if started else stream.start()
                started = True
                if isinstance(event, TextDelta):
                    return out + stream.feed(output.feed(0, event.text))
                if event is None:
                    return out
                out += stream.feed(output.finish(0))
                if calls is not None:
                    frontend.metrics.tool_calls.inc(calls.num_calls(0))
                return out + stream.finish(event)

            return StreamingResponse(
                named_sse(got[0], events, render, _stream_error),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        answer = await single_answer(http, events, frontend, output)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        message, done = answer
        reason = stop_reason(done, bool(message.get("tool_calls")))
        body_out = message_body(
            rid, frontend.model_name, content_blocks(message), reason, usage(done, prompt_tokens)
        )
        return JSONResponse(body_out)


def _stream_error(exc: ServiceError) -> list[SseEvent]:
    return [("error", anthropic_error_body(exc.http_status, exc.message))]
