"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`:
OpenAI's Responses API, run by the chat-completions path.

The body is translated into a chat-completions request (`protocol.py`) and run by
`OpenAIRoutes.chat_run` (one engine path: its chat template, tool calls and structured
outputs); only the answer is rendered here (`render.py`). Stateless unless asked: a response
is stored (`store.py`, in memory, per tenant) only when the request sets `store: true`, and
only a stored response can be continued (`previous_response_id`), read or deleted. With the
store disabled (`--responses-store-max-entries 0`), `store: true` and `previous_response_id`
are refused with 400 naming them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.controlplane.errors import ServiceError, clip, invalid_argument
from pagedserve.controlplane.frontend import StreamEvent, TextDelta
from pagedserve.controlplane.openai.errors import error_body
from pagedserve.controlplane.openai.routes import CLIENT_CLOSED_REQUEST, OpenAIRoutes
from pagedserve.controlplane.openai.running import SseEvent, merged_events, named_sse, opened, single_answer
from pagedserve.controlplane.responses.input_items import DEFAULT_LIMIT, input_items, page
from pagedserve.controlplane.responses.protocol import MAX_ID_CHARS, ResponsesRequest, translate
from pagedserve.controlplane.responses.render import (
    ResponseObject,
    ResponseStream,
    assistant_message,
    final_status,
    new_id,
    output_items,
    usage,
)
from pagedserve.controlplane.responses.store import ResponseStore, StoredResponse
from pagedserve.controlplane.tenancy.auth import request_tenant

PATH = "/v1/responses"


class ResponsesRoutes:
    def __init__(self, chat: OpenAIRoutes, store: ResponseStore) -> None:
        self.chat, self.store = chat, store
        self.router = APIRouter()
        route = self.router.add_api_route
        route(PATH, self.create, methods=["POST"], response_model=None)
        route(PATH + "/{response_id}", self.retrieve, methods=["GET"])
        route(PATH + "/{response_id}", self.delete, methods=["DELETE"])
        route(PATH + "/{response_id}/input_items", self.list_input_items, methods=["GET"])

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id, "response_id").response

    async def list_input_items(
        self, response_id: str, limit: int = DEFAULT_LIMIT, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        return page(self._stored(response_id, "response_id").input_items, limit, order, after)

    async def delete(self, response_id: str) -> dict[str, Any]:
        self._stored(response_id, "response_id")
        self.store.delete(request_tenant(), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str, field: str) -> StoredResponse:
        if len(response_id) > MAX_ID_CHARS:
            raise invalid_argument(f"{field}: at most {MAX_ID_CHARS} characters", field)
        entry = self.store.get(request_tenant(), response_id)
        if entry is None:
            raise ServiceError(
                "NOT_FOUND",
                f"{field}: no stored response {clip(response_id)!r} (responses are kept only when created "
                "with store: true, in this server's memory, for a limited time)",
                param=field,
            )
        return entry

    async def create(self, body: ResponsesRequest, http: Request) -> Response:
        history: list[dict[str, Any]] = []
        if body.store and not self.store.enabled:
            raise invalid_argument("store: this server keeps no responses (its store is disabled)", "store")
        if body.previous_response_id is not None:
            if not self.store.enabled:
                raise invalid_argument(
                    "previous_response_id: this server keeps no responses (its store is disabled): "
                    "send the whole conversation as input",
                    "previous_response_id",
                )
            history = self._stored(body.previous_response_id, "previous_response_id").conversation
        translated = translate(body, history)
        try:
            run = self.chat.chat_run(translated.chat, http)
        except ServiceError as exc:
            raise translated.renamed(exc) from None
        frontend, calls, output = self.chat.frontend, run.calls, run.output
        tenant = request_tenant()
        response = ResponseObject(new_id("resp"), frontend.model_name, _echo(body))
        prompt_tokens = run.gens[0].num_prompt_tokens
        events = merged_events(frontend, run.gens, 1, http)

        def keep(out: dict[str, Any]) -> None:
            if body.store:
                conversation = [*translated.conversation, assistant_message(out["output"])]
                self.store.put(tenant, out["id"], out, conversation, input_items(body.input))

        if body.stream:
            got = await opened(http, events)
            if got is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            stream = ResponseStream(response, prompt_tokens)
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
                closing, final = stream.finish(event)
                keep(final)
                return out + closing

            def render_error(exc: ServiceError) -> list[SseEvent]:
                error = error_body(exc.http_status, exc.message, exc.param, exc.code.lower())["error"]
                return [("error", {"type": "error", "sequence_number": stream.sequence, **error})]

            return StreamingResponse(
                named_sse(got[0], events, render, render_error),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        answer = await single_answer(http, events, frontend, output)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        message, done = answer
        out = response.body(final_status(done), output_items(message), usage(done, prompt_tokens))
        keep(out)
        return JSONResponse(out)


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response reports them."""
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": tool_choice,
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "store": bool(body.store),
        "metadata": body.metadata or {},
        "truncation": "disabled",
    }
