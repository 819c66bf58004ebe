"""The OpenAI-compatible routes, over the same `Frontend` as the gRPC API. No torch.

Streaming is server-sent events (`data: {chunk}` ... `data: [DONE]`), with a final usage
chunk when `stream_options.include_usage` is set. Errors use OpenAI's error JSON with the
status the gRPC code maps to (400 bad field, 401, 404 model, 429 queue full, 503 no data
plane). A client that disconnects aborts its request (and frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from controlplane.errors import ServiceError, invalid_argument
from controlplane.frontend import CompletionDone, Frontend, StreamEvent, TextDelta
from controlplane.openai.protocol import ChatCompletionRequest, CompletionRequest
from controlplane.request import GenerationRequest
from pagedserve.common.telemetry import extract
from protos.pagedserve.v1 import common_pb2

_DISCONNECT_POLL_S = 0.5
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_response(exc: ServiceError, param: str | None = None) -> JSONResponse:
    status = exc.http_status
    body = {
        "error": {
            "message": exc.message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": exc.code.lower(),
        }
    }
    headers = {"retry-after": f"{max(1, round(exc.retry_after_s))}"} if exc.retry_after_s else None
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, frontend: Frontend) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = (
            f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg", "invalid request"))
        )
        error = invalid_argument(message)
        frontend.record_failure(error)
        return error_response(error, param=loc or None)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        frontend.record_failure(exc)
        return error_response(exc)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    done: CompletionDone | None = None


class OpenAIRoutes:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        self.router.add_api_route(
            "/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None
        )

    # -- /v1/models -----------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        cards: list[dict[str, Any]] = []
        for model in self.frontend.model_cards():
            card: dict[str, Any] = {"id": model.id, "object": "model", "created": 0, "owned_by": "pagedserve"}
            if model.max_model_len is not None:
                card["max_model_len"] = model.max_model_len
            cards.append(card)
        return {"object": "list", "data": cards}

    # -- shared -----------------------------------------------------------------------------------
    @staticmethod
    def _sampling(
        body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
    ) -> dict[str, object]:
        """The sampling fields the body sets, named as SamplingParams names them (for
        `Frontend.validate`; an unset max_tokens means the rest of the context)."""
        values: dict[str, object] = {
            "n": body.n,
            "ignore_eos": body.ignore_eos,
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
        ):
            value = getattr(body, name)
            if value is not None:
                values[name] = value
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        if logprobs is not None:
            values["logprobs"] = logprobs
        return values

    def _requests(
        self,
        prompts: Sequence[list[int]],
        body: CompletionRequest | ChatCompletionRequest,
        sampling: dict[str, object],
        http: Request,
    ) -> list[GenerationRequest]:
        self.frontend.check_model(body.model)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        base = http.headers.get("x-request-id") or uuid.uuid4().hex
        return [
            self.frontend.validate(
                prompt,
                sampling,
                stop,
                request_id=base if len(prompts) == 1 else f"{base}-{i}",
                cache_salt=body.cache_salt,
                field_prefix="",
            )
            for i, prompt in enumerate(prompts)
        ]

    async def _merged(
        self, gens: list[GenerationRequest], n: int, http: Request
    ) -> AsyncIterator[StreamEvent]:
        """Events of several prompts' streams, choice index = prompt index × n + sample."""
        parent = extract(http.headers.items())
        if len(gens) == 1:
            async for event in self.frontend.stream(gens[0], parent=parent):
                yield event
            return
        queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, gen: GenerationRequest) -> None:
            try:
                async for event in self.frontend.stream(gen, parent=parent):
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
                elif isinstance(item, TextDelta):
                    yield TextDelta(i * n + item.index, item.token_ids, item.text, item.logprobs)
                else:
                    yield dataclasses.replace(item, index=i * n + item.index)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _respond(
        self,
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        gens: list[GenerationRequest],
        render_chunk: Any,
        render_final: Any,
        render_usage_chunk: Any,
    ) -> Response:
        """Run the requests; stream SSE chunks or answer one JSON body, as the client asked."""
        events = self._merged(gens, body.n, http)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await _first(events)  # admission errors still get a proper status code
            return StreamingResponse(
                _sse(first, events, render_chunk, render_usage_chunk if include_usage else None),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        choices: dict[int, _Choice] = {}

        async def collect() -> None:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    c = choices.setdefault(event.index, _Choice())
                    if isinstance(event, TextDelta):
                        c.text.append(event.text)
                        c.token_ids.extend(event.token_ids)
                        c.logprobs.extend(event.logprobs)
                    else:
                        c.done = event

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()  # the client left: abort the request, free its blocks
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        task.result()  # re-raises a ServiceError
        return JSONResponse(render_final(dict(sorted(choices.items()))))

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        if body.echo:
            raise invalid_argument("echo: not supported")
        if body.suffix:
            raise invalid_argument("suffix: not supported")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid_argument("best_of: only best_of == n is supported")
        prompts = self._completion_prompts(body.prompt)
        gens = self._requests(prompts, body, self._sampling(body, body.max_tokens, body.logprobs), http)
        rid, created = f"cmpl-{gens[0].request_id}", int(time.time())
        decode = self._token_text
        wants_logprobs = body.logprobs is not None

        def legacy_logprobs(
            token_ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprob], offset: int
        ) -> dict[str, Any] | None:
            if not wants_logprobs:
                return None
            tokens = [decode(t) for t in token_ids]
            offsets, pos = [], offset
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{decode(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": offsets,
            }

        def base(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
            out = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.frontend.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        def chunk(event: StreamEvent) -> dict[str, Any]:
            if isinstance(event, TextDelta):
                return base(
                    [
                        {
                            "index": event.index,
                            "text": event.text,
                            "logprobs": legacy_logprobs(event.token_ids, event.logprobs, 0),
                            "finish_reason": None,
                        }
                    ]
                )
            return base(
                [{"index": event.index, "text": "", "logprobs": None, "finish_reason": _finish(event)}]
            )

        def final(choices: dict[int, _Choice]) -> dict[str, Any]:
            out = []
            for index, c in choices.items():
                out.append(
                    {
                        "index": index,
                        "text": "".join(c.text),
                        "logprobs": legacy_logprobs(c.token_ids, c.logprobs, 0),
                        "finish_reason": _finish(c.done) if c.done else None,
                    }
                )
            return base(out, _usage([c.done for c in choices.values() if c.done], body.n))

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], _usage(done, body.n))

        return await self._respond(http, body, gens, chunk, final, usage_chunk)

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.frontend.encode_text(prompt, "prompt")]
        if not prompt:
            raise invalid_argument("prompt must not be empty")
        if all(isinstance(p, str) for p in prompt):
            return [self.frontend.encode_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, int) for p in prompt):
            return [self.frontend.check_token_ids(prompt, "prompt")]  # type: ignore[arg-type]
        return [self.frontend.check_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]  # type: ignore[arg-type]

    # -- /v1/chat/completions ---------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = self.frontend.encode_chat(messages, "messages")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise invalid_argument("top_logprobs must be in [0, 20]")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        gens = self._requests([prompt], body, self._sampling(body, max_tokens, logprobs), http)
        rid, created = f"chatcmpl-{gens[0].request_id}", int(time.time())
        decode = self._token_text

        def chat_logprobs(
            token_ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprob]
        ) -> dict[str, Any] | None:
            if not body.logprobs:
                return None
            content = []
            for t, lp in zip(token_ids, lps, strict=False):
                text = decode(t)
                top = [
                    {
                        "token": decode(x.token_id),
                        "logprob": x.logprob,
                        "bytes": list(decode(x.token_id).encode()),
                    }
                    for x in lp.top
                ]
                content.append(
                    {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top}
                )
            return {"content": content}

        def base(
            choices: list[dict[str, Any]], obj: str, usage: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.frontend.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        started: set[int] = set()

        def chunk(event: StreamEvent) -> dict[str, Any]:
            if isinstance(event, TextDelta):
                delta: dict[str, Any] = {"content": event.text}
                if event.index not in started:  # the first chunk of each choice names the role
                    started.add(event.index)
                    delta = {"role": "assistant", **delta}
                choice = {
                    "index": event.index,
                    "delta": delta,
                    "logprobs": chat_logprobs(event.token_ids, event.logprobs),
                    "finish_reason": None,
                }
                return base([choice], "chat.completion.chunk")
            return base(
                [{"index": event.index, "delta": {}, "logprobs": None, "finish_reason": _finish(event)}],
                "chat.completion.chunk",
            )

        def final(choices: dict[int, _Choice]) -> dict[str, Any]:
            out = [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(c.token_ids, c.logprobs),
                    "finish_reason": _finish(c.done) if c.done else None,
                }
                for index, c in choices.items()
            ]
            return base(out, "chat.completion", _usage([c.done for c in choices.values() if c.done], body.n))

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], "chat.completion.chunk", _usage(done, body.n))

        return await self._respond(http, body, gens, chunk, final, usage_chunk)

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)


def _finish(done: CompletionDone) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def _usage(done: list[CompletionDone], n: int) -> dict[str, Any]:
    """OpenAI usage: prompt (and cached) tokens count once per prompt, not once per sample."""
    first_of_prompt: dict[int, CompletionDone] = {}
    for d in done:
        first_of_prompt.setdefault(d.index // n, d)
    prompt = sum(d.prompt_tokens for d in first_of_prompt.values())
    completion = sum(d.completion_tokens for d in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in first_of_prompt.values())},
    }


async def _first(events: AsyncIterator[StreamEvent]) -> StreamEvent | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def _sse(
    first: StreamEvent | None, events: AsyncIterator[StreamEvent], render: Any, render_usage: Any
) -> AsyncIterator[str]:
    done: list[CompletionDone] = []
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
                yield f"data: {json.dumps(render(event))}\n\n"
    except ServiceError as exc:  # after the headers went out: report it in the stream
        yield f"data: {json.dumps({'error': {'message': exc.message, 'type': _ERROR_TYPES.get(exc.http_status, 'server_error'), 'code': exc.code.lower()}})}\n\n"
    if render_usage is not None:
        yield f"data: {json.dumps(render_usage(done))}\n\n"
    yield "data: [DONE]\n\n"
