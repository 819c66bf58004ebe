"""The OpenAI-compatible routes, over the same `Frontend` as the gRPC API. No torch.

`/v1/models` (and `/v1/models/{id}`), `/v1/completions`, `/v1/chat/completions`, and vLLM's
`/tokenize`, `/detokenize` and `/version`. Streaming is server-sent events (`data: {chunk}`
... `data: [DONE]`), with a final usage chunk when `stream_options.include_usage` is set (and the
usage so far on every chunk with `continuous_usage_stats`, as vLLM). Structured outputs
(`response_format`, `structured_outputs`, `guided_*`) are read by `structured.py` into the
request's constraint, named as the client put it.
Every error, including a body that is not JSON, a route that does not exist or a wrong method,
is OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}` with `param` naming
the field the message is about, and the status the gRPC code maps to (400 bad field, 401,
404, 405, 413, 429 queue full, 503 no data plane). A client that disconnects, while its
request waits for admission or while it runs, aborts it (and frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.errors import ServiceError, clip, invalid_argument
from controlplane.frontend import CompletionDone, Frontend, StreamEvent, TextDelta
from controlplane.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from controlplane.openai.structured import Structured, structured_output
from controlplane.openai.tool_calls import ChoiceToolCalls
from controlplane.request import GenerationRequest
from controlplane.tools.definitions import ToolUse, parse_openai_tools
from controlplane.tools.forced import forced_constraint
from controlplane.tools.output import finish_reason
from pagedserve import __version__
from pagedserve.common.invalid_field import InvalidField
from pagedserve.common.log import get_logger
from pagedserve.common.telemetry import extract
from protos.pagedserve.v1 import common_pb2

log = get_logger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# Pydantic's names for the members of a union field (they appear in an error's location).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def error_body(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def openai_error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error that exists only over HTTP (404 route, 405, 413), in OpenAI's error JSON."""
    code = _HTTP_CODES.get(status, "internal" if status >= 500 else "invalid_request")
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def error_response(exc: ServiceError, param: str | None = None) -> JSONResponse:
    status = exc.http_status
    body = error_body(status, exc.message, param or exc.param, exc.code.lower())
    headers = {"retry-after": f"{max(1, round(exc.retry_after_s))}"} if exc.retry_after_s else None
    return JSONResponse(body, status_code=status, headers=headers)


def _location(loc: Sequence[Any]) -> tuple[str | None, bool]:
    """A pydantic error location as the client names the field (`messages[0].role`), and
    whether it ran into a union (the part after that names one alternative's guess only)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part:
            return (clip(out, 128) if out else None), True
        else:
            out += f".{part}" if out else part
    return (clip(out, 128) if out else None), False


def describe_validation_error(
    errors: Sequence[Any], content_type: str = "application/json"
) -> tuple[str, str | None]:
    """(message, param) for FastAPI's errors about a request body sent as `content_type`."""
    if not errors:
        return "the request is not valid", None
    first = errors[0]
    kind = first.get("type")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "decode error")
        return f"the request body is not valid JSON: {reason}", None
    if not loc:
        if "json" not in content_type.lower():  # FastAPI parses JSON only when told it is JSON
            got = clip(content_type, 48) if content_type else "none"
            return (
                f"the request body must be JSON, sent with content-type: application/json (got {got})",
                None,
            )
        if kind == "missing":
            return "the request body is missing: send a JSON object", None
        return "the request body must be a JSON object", None
    param, union = _location(loc)
    if union:  # no member of a union field matched: the first member's complaint misleads
        return f"{param}: not any of the accepted forms ({first.get('msg', 'invalid value')})", param
    return f"{param}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI, frontend: Frontend) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors(), request.headers.get("content-type", ""))
        error = invalid_argument(message, param)
        frontend.record_failure(error)
        return error_response(error)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        frontend.record_failure(exc)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = clip(request.url.path, 128)
        if exc.status_code == 404:
            message = f"no such route: {request.method} {path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
        else:
            message = str(exc.detail)
        return openai_error(exc.status_code, message, headers=dict(exc.headers or {}) or None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("http_internal_error", path=clip(request.url.path, 128))
        return openai_error(500, "internal server error")


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
        route = self.router.add_api_route
        route("/v1/models", self.models, methods=["GET"])
        route("/v1/models/{model:path}", self.model, methods=["GET"])
        route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        route("/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        route("/tokenize", self.tokenize, methods=["POST"])
        route("/detokenize", self.detokenize, methods=["POST"])
        route("/version", self.version, methods=["GET"])

    # -- /v1/models, /version -------------------------------------------------------------------
    def _cards(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = []
        for model in self.frontend.model_cards():
            card: dict[str, Any] = {"id": model.id, "object": "model", "created": 0, "owned_by": "pagedserve"}
            if model.max_model_len is not None:
                card["max_model_len"] = model.max_model_len
            cards.append(card)
        return cards

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": self._cards()}

    async def model(self, model: str) -> dict[str, Any]:
        self.frontend.check_model(model)
        return next(card for card in self._cards() if card["id"] == model)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    # -- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """The prompt's token ids exactly as generation would see them (chat messages rendered
        with the model's template; no special tokens added to a text prompt)."""
        self.frontend.check_model(body.model)
        if body.return_token_strs:
            raise invalid_argument("return_token_strs: not supported by this server", "return_token_strs")
        if (body.prompt is None) == (body.messages is None):
            raise invalid_argument("send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            if body.add_special_tokens:
                raise invalid_argument(
                    "add_special_tokens: not supported with messages", "add_special_tokens"
                )
            messages = [m.template_message() for m in body.messages]
            tokens = self.frontend.encode_chat(messages, "messages", bool(body.add_generation_prompt))
        else:
            if body.add_special_tokens:
                raise invalid_argument(
                    "add_special_tokens: this server never adds special tokens to a prompt; "
                    "omit it or send false",
                    "add_special_tokens",
                )
            tokens = self.frontend.encode_text(body.prompt or "", "prompt")
        return {"count": len(tokens), "max_model_len": self.frontend.max_model_len(), "tokens": tokens}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.frontend.check_model(body.model)
        ids = self.frontend.check_token_ids(body.tokens, "tokens") if body.tokens else []
        return {"prompt": self.frontend.tokenizer.decode(ids)}

    # -- shared -----------------------------------------------------------------------------------
    @staticmethod
    def _sampling(
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
        ):
            value = getattr(body, name)
            if value is not None:
                values[name] = value
        if body.logit_bias:
            values["logit_bias"] = _logit_bias(body.logit_bias)
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
        structured: Structured,
        field_names: dict[str, str] | None = None,
    ) -> list[GenerationRequest]:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if structured.constraint is not None:  # named (and renamed on refusal) as the client put it
            sampling = {**sampling, "constraint": structured.constraint}
            field_names = {**(field_names or {}), **structured.field_names}
        label = http.headers.get("x-request-id")
        return [
            self.frontend.validate(
                prompt,
                sampling,
                stop,
                request_id=label if label is None or len(prompts) == 1 else f"{label}-{i}",
                cache_salt=body.cache_salt,
                field_prefix="",
                field_names=field_names,
                request_id_field="x-request-id",
            )
            for i, prompt in enumerate(prompts)
        ]

    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> Structured:
        """What is checked before any prompt is tokenized: the model, refused parameters, the
        structured output asked for (returned)."""
        self.frontend.check_model(body.model)
        refused = body.unsupported()
        if refused is not None:
            param, message = refused
            raise invalid_argument(message, param)
        return structured_output(body.model_extra or {})

    async def _merged(
        self, gens: list[GenerationRequest], n: int, http: Request
    ) -> AsyncGenerator[StreamEvent, None]:
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
        """Run the requests; stream SSE chunks or answer one JSON body, as the client asked.
        Until the answer starts, a client that disconnects cancels the request at once (out
        of the admission queue if it waits there: it is never admitted, never runs)."""
        events = self._merged(gens, body.num_choices, http)
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            # vLLM's `continuous_usage_stats`: the usage so far on every chunk (with include_usage).
            running_prompt_tokens = (
                sum(g.num_prompt_tokens for g in gens)
                if include_usage and options is not None and options.continuous_usage_stats
                else None
            )

            # Wait for the first event here: admission errors still get a proper status code.
            async def first_event() -> tuple[StreamEvent | None]:
                return (await _first(events),)

            got = await unless_disconnected(http, first_event())
            if got is None:  # the client left while its request queued or prefilled
                await events.aclose()
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return StreamingResponse(
                _sse(
                    got[0],
                    events,
                    render_chunk,
                    render_usage_chunk if include_usage else None,
                    running_prompt_tokens,
                ),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        choices: dict[int, _Choice] = {}
        finished = False

        async def collect() -> None:
            nonlocal finished
            async with contextlib.aclosing(events):
                async for event in events:
                    c = choices.setdefault(event.index, _Choice())
                    if isinstance(event, TextDelta):
                        c.text.append(event.text)
                        c.token_ids.extend(event.token_ids)
                        c.logprobs.extend(event.logprobs)
                    else:
                        c.done = event
            finished = True

        await unless_disconnected(http, collect())  # re-raises a ServiceError
        if not finished:  # the client left: the request was aborted, its blocks freed
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(render_final(dict(sorted(choices.items()))))

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        structured = self._check(body)
        self.frontend.check_batch(_num_prompts(body.prompt), body.num_choices)
        prompts = self._completion_prompts(body.prompt)
        sampling = self._sampling(body, body.max_tokens, body.logprobs)
        gens = self._requests(prompts, body, sampling, http, structured)
        rid, created = f"cmpl-{_response_id(http)}", int(time.time())
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
                "token_logprobs": [_logprob(lp.logprob) for lp in lps],
                "top_logprobs": [{decode(t.token_id): _logprob(t.logprob) for t in lp.top} for lp in lps],
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
            return base(out, _usage([c.done for c in choices.values() if c.done], body.num_choices))

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], _usage(done, body.num_choices))

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
        structured = self._check(body)
        tool_use = _tool_use(body, structured)
        forced = forced_constraint(tool_use)
        if forced is not None:
            constraint, where = forced
            structured = Structured(constraint, {"json_schema": where})
        messages = [m.template_message() for m in body.messages]
        prompt = self.frontend.encode_chat(messages, "messages", tool_use=tool_use)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        names = {"logprobs": "top_logprobs"}
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        sampling = self._sampling(body, max_tokens, logprobs)
        gens = self._requests([prompt], body, sampling, http, structured, names)
        rid, created = f"chatcmpl-{_response_id(http)}", int(time.time())
        calls = (
            ChoiceToolCalls(tool_use, self.frontend.tool_call_format) if tool_use.choice.calls_tools else None
        )
        metrics = self.frontend.metrics
        if tool_use.tools:
            metrics.tool_requests.labels(tool_choice=tool_use.choice.mode).inc()
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
                        "logprob": _logprob(x.logprob),
                        "bytes": list(decode(x.token_id).encode()),
                    }
                    for x in lp.top
                ]
                content.append(
                    {
                        "token": text,
                        "logprob": _logprob(lp.logprob),
                        "bytes": list(text.encode()),
                        "top_logprobs": top,
                    }
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

        def chunk(event: StreamEvent) -> dict[str, Any] | None:
            if isinstance(event, TextDelta):
                delta: dict[str, Any] = (
                    {"content": event.text} if calls is None else calls.feed(event.index, event.text)
                )
                if event.index not in started:  # the first chunk of each choice names the role
                    started.add(event.index)
                    delta = {"role": "assistant", **delta}
                elif not delta and not body.logprobs:
                    return None  # a tool-call parser held this text back: nothing to send yet
                choice = {
                    "index": event.index,
                    "delta": delta,
                    "logprobs": chat_logprobs(event.token_ids, event.logprobs),
                    "finish_reason": None,
                }
                return base([choice], "chat.completion.chunk")
            last: dict[str, Any] = {} if calls is None else calls.finish(event.index)
            if calls is not None:
                metrics.tool_calls.inc(calls.num_calls(event.index))
            reason = (
                _finish(event)
                if calls is None
                else finish_reason(_finish(event), calls.has_calls(event.index))
            )
            return base(
                [{"index": event.index, "delta": last, "logprobs": None, "finish_reason": reason}],
                "chat.completion.chunk",
            )

        def final(choices: dict[int, _Choice]) -> dict[str, Any]:
            out = []
            for index, c in choices.items():
                text = "".join(c.text)
                if calls is None:
                    message: dict[str, Any] = {"role": "assistant", "content": text}
                    reason = _finish(c.done) if c.done else None
                else:
                    message = calls.message(index, text)
                    metrics.tool_calls.inc(calls.num_calls(index))
                    reason = finish_reason(_finish(c.done), calls.has_calls(index)) if c.done else None
                out.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs),
                        "finish_reason": reason,
                    }
                )
            return base(
                out, "chat.completion", _usage([c.done for c in choices.values() if c.done], body.num_choices)
            )

        def usage_chunk(done: list[CompletionDone]) -> dict[str, Any]:
            return base([], "chat.completion.chunk", _usage(done, body.num_choices))

        return await self._respond(http, body, gens, chunk, final, usage_chunk)

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False)


MIN_LOGPROB = -9999.0
"""What a logprob of -inf is reported as (vLLM's floor): a token a structured output's grammar
masks has probability 0, and JSON has no infinity."""


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _tool_use(body: ChatCompletionRequest, structured: Structured) -> ToolUse:
    """The request's tools and tool_choice; a forced call with a structured output is refused
    (both would constrain the same text)."""
    try:
        use = parse_openai_tools(body.model_extra or {})
    except InvalidField as exc:
        raise invalid_argument(f"{exc.field} {clip(exc.reason, 200)}", exc.field) from None
    if use.choice.forced and structured.constraint is not None:
        source = next(iter(structured.field_names.values()), "response_format")
        raise invalid_argument(
            f"tool_choice: a forced tool call ({use.choice.mode}) cannot be combined with {source}",
            "tool_choice",
        )
    return use


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys are strings) keyed by token id; values are checked with
    the other sampling fields."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key.strip()
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise invalid_argument(f"logit_bias keys must be token ids, got {clip(key, 16)!r}", "logit_bias")
        out[int(token)] = value
    return out


def _num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _response_id(http: Request) -> str:
    """The response's id: the client's x-request-id if it sent one (validated with the
    request), else a fresh one; never the server's internal request id."""
    return http.headers.get("x-request-id") or uuid.uuid4().hex


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
