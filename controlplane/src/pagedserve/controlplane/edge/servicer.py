"""`GenerationService` over grpc.aio: the wire format around `Frontend`.

Register it with `add_generation_service`: the handlers parse their own requests, so a payload
that is not the method's message is INVALID_ARGUMENT (grpcio's deserializer would end the
call UNKNOWN, as if the server had failed). The same wrapper is the API's one error boundary
(`_fail`): the methods only decode, call the frontend and encode; a ServiceError they raise
becomes its status, anything else a logged INTERNAL naming the request id.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from pagedserve.common.invalid_field import InvalidField
from pagedserve.common.log import get_logger
from pagedserve.common.protocol import (
    FINISH_REASON_BY_NAME,
    pooling_params_from_proto,
    sampling_fields_from_proto,
)
from pagedserve.common.telemetry import extract
from pagedserve.controlplane.embeddings import Embedder
from pagedserve.controlplane.errors import ServiceError, invalid_argument
from pagedserve.controlplane.frontend import MAX_NAME_CHARS, CompletionDone, Frontend
from pagedserve.controlplane.request import new_request_id
from pagedserve.controlplane.tools.definitions import NO_TOOLS, ToolUse
from pagedserve.controlplane.tools.from_proto import chat_messages, chat_tool_use, forced_tool_constraint
from pagedserve.controlplane.tools.output import CompletionParsers, finish_reason
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = get_logger(__name__)


def _truncate_prompt_tokens(params: common_pb2.SamplingParams) -> int | None:
    return params.truncate_prompt_tokens if params.HasField("truncate_prompt_tokens") else None


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.embedder = Embedder(frontend)

    def _prompt_ids(
        self, request: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest
    ) -> tuple[list[int], ToolUse]:
        """The prompt's token ids and, for a chat, the tools it lets the model call."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.frontend.encode_text(request.text), NO_TOOLS
        if kind == "chat":
            use = dataclasses.replace(
                chat_tool_use(request.chat), max_calls=self.frontend.dispatcher.config.max_tool_calls
            )
            messages = chat_messages(request.chat)
            return self.frontend.encode_chat(messages, tool_use=use), use
        if kind == "token_ids":
            return self.frontend.check_token_ids(list(request.token_ids.ids)), NO_TOOLS  # type: ignore[union-attr]
        raise invalid_argument("prompt: set one of text, token_ids or chat")

    async def Generate(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse],
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        start = time.monotonic()
        remaining = context.time_remaining()
        self.frontend.check_model(request.model or None)  # proto3: "" is unset
        await self.frontend.dispatcher.wait_for_startup(None if remaining is None else start + remaining)
        prompt, use = self._prompt_ids(request)
        try:
            sampling = sampling_fields_from_proto(request.sampling_params)
        except InvalidField as exc:  # an id list refused before it is copied out of the message
            name = f"sampling_params.{exc.field}"
            raise invalid_argument(f"{name} {exc.reason}", name) from None
        forced = forced_tool_constraint(use, sampling)
        if forced is not None:
            sampling["constraint"] = forced[0]
        gen = self.frontend.validate(
            prompt,
            sampling,
            request.sampling_params.stop,
            request_id=request.request_id or None,
            cache_salt=request.cache_salt or None,
            priority=request.priority,
            deadline=None if remaining is None else start + remaining,
            include_stop_str_in_output=request.sampling_params.include_stop_str_in_output,
            truncate_prompt_tokens=_truncate_prompt_tokens(request.sampling_params),
            bad_words=request.sampling_params.bad_words,
        )
        if forced is not None:  # a compile refusal names the tools, not sampling_params
            gen = dataclasses.replace(gen, constraint_field=forced[1])
        rid = gen.label  # the client's id echoed (the server keys the request by its own)
        parent = extract(context.invocation_metadata() or ())
        parsers = CompletionParsers(use, self.frontend.tool_call_format)
        if use.tools:
            self.frontend.metrics.tool_requests.labels(tool_choice=use.choice.mode).inc()
        async for event in self.frontend.stream(gen, start, parent):
            if isinstance(event, CompletionDone):
                reason, calls, content = event.finish_reason, [], ""
                if use.choice.calls_tools:
                    parser = parsers(event.index)
                    parser.finish()
                    calls, content = parser.tool_calls, parser.content
                    self.frontend.metrics.tool_calls.inc(len(calls))
                    reason = finish_reason(reason, bool(calls))
                yield generation_pb2.GenerateResponse(
                    request_id=rid,
                    complete=generation_pb2.GenerateComplete(
                        index=event.index,
                        finish_reason=FINISH_REASON_BY_NAME[reason],
                        tool_calls=[
                            generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                            for c in calls
                        ],
                        content=content,
                        stop_string=event.stop_string or "",
                        usage=common_pb2.Usage(
                            prompt_tokens=event.prompt_tokens,
                            completion_tokens=event.completion_tokens,
                            cached_tokens=event.cached_tokens,
                            spec_draft_tokens=event.spec_draft_tokens,
                            spec_accepted_tokens=event.spec_accepted_tokens,
                        ),
                        timings=generation_pb2.Timings(
                            queue_seconds=event.queue_seconds,
                            time_to_first_token_seconds=event.time_to_first_token_seconds,
                            e2e_seconds=event.e2e_seconds,
                        ),
                    ),
                )
            else:
                if use.choice.calls_tools:
                    parsers(event.index).feed(event.text)
                yield generation_pb2.GenerateResponse(
                    request_id=rid,
                    chunk=generation_pb2.TokenChunk(
                        index=event.index,
                        token_ids=event.token_ids,
                        text=event.text,
                        logprobs=event.logprobs,
                        prompt_logprobs=event.prompt_logprobs,
                    ),
                )

    async def Embed(
        self,
        request: generation_pb2.EmbedRequest,
        context: grpc.aio.ServicerContext[generation_pb2.EmbedRequest, generation_pb2.EmbedResponse],
    ) -> generation_pb2.EmbedResponse:
        start = time.monotonic()
        remaining = context.time_remaining()
        deadline = None if remaining is None else start + remaining
        self.frontend.check_model(request.model or None)
        self.embedder.check_count(len(request.inputs), "inputs")
        await self.frontend.dispatcher.wait_for_startup(deadline)
        try:
            pooling = pooling_params_from_proto(request.pooling)
        except InvalidField as exc:
            name = f"pooling.{exc.field}"
            raise invalid_argument(f"{name} {exc.reason}", name) from None
        names = [f"inputs[{i}]" for i in range(len(request.inputs))]
        inputs = [self._embed_input(item, name) for item, name in zip(request.inputs, names, strict=True)]
        gens = self.embedder.requests(
            inputs,
            pooling,
            field_names=names,
            request_id=request.request_id or None,
            priority=request.priority,
            deadline=deadline,
            truncate_prompt_tokens=(
                request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
            ),
        )
        embedded = await self.embedder.embed(gens)
        tokens = sum(e.prompt_tokens for e in embedded)
        return generation_pb2.EmbedResponse(
            request_id=gens[0].label,
            embeddings=[
                generation_pb2.Embedding(index=e.index, values=e.values, prompt_tokens=e.prompt_tokens)
                for e in embedded
            ],
            usage=common_pb2.Usage(prompt_tokens=tokens),
        )

    def _embed_input(self, item: generation_pb2.EmbedInput, name: str) -> list[int]:
        kind = item.WhichOneof("input")
        if kind == "text":
            return self.embedder.token_ids(item.text, f"{name}.text")
        if kind == "token_ids":
            return self.embedder.token_ids(list(item.token_ids.ids), f"{name}.token_ids")
        raise invalid_argument(f"{name}: set one of text or token_ids", name)

    async def Tokenize(
        self,
        request: generation_pb2.TokenizeRequest,
        context: grpc.aio.ServicerContext[generation_pb2.TokenizeRequest, generation_pb2.TokenizeResponse],
    ) -> generation_pb2.TokenizeResponse:
        self.frontend.check_model(request.model or None)
        return generation_pb2.TokenizeResponse(token_ids=self._prompt_ids(request)[0])

    async def Detokenize(
        self,
        request: generation_pb2.DetokenizeRequest,
        context: grpc.aio.ServicerContext[
            generation_pb2.DetokenizeRequest, generation_pb2.DetokenizeResponse
        ],
    ) -> generation_pb2.DetokenizeResponse:
        self.frontend.check_model(request.model or None)
        ids = self.frontend.check_token_ids(list(request.token_ids), "token_ids") if request.token_ids else []
        return generation_pb2.DetokenizeResponse(text=self.frontend.tokenizer.decode(ids))

    async def ListModels(
        self,
        request: generation_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[
            generation_pb2.ListModelsRequest, generation_pb2.ListModelsResponse
        ],
    ) -> generation_pb2.ListModelsResponse:
        response = generation_pb2.ListModelsResponse()
        for card in self.frontend.model_cards():
            pb = response.models.add(id=card.id)
            if card.max_model_len is not None:
                pb.max_model_len = card.max_model_len
            if card.block_size is not None:
                pb.block_size = card.block_size
            if card.kv_cache_dtype is not None:
                pb.kv_cache_dtype = card.kv_cache_dtype
        return response


async def abort_with(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", f"{exc.retry_after_s:g}"),))
    await context.abort(grpc.StatusCode[exc.code], exc.message)


SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
_MESSAGES: dict[str, tuple[type[Message], type[Message]]] = {
    "Generate": (generation_pb2.GenerateRequest, generation_pb2.GenerateResponse),
    "Tokenize": (generation_pb2.TokenizeRequest, generation_pb2.TokenizeResponse),
    "Detokenize": (generation_pb2.DetokenizeRequest, generation_pb2.DetokenizeResponse),
    "ListModels": (generation_pb2.ListModelsRequest, generation_pb2.ListModelsResponse),
    "Embed": (generation_pb2.EmbedRequest, generation_pb2.EmbedResponse),
}


async def _parse(
    frontend: Frontend, raw: bytes, request_type: type[Message], context: grpc.aio.ServicerContext
) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError:
        exc = invalid_argument(f"the request is not a valid {request_type.DESCRIPTOR.full_name} message")
        frontend.record_failure(exc)
        await abort_with(context, exc)


def _request_label(request: Any) -> str:
    """The id a log line and an INTERNAL message name: the client's, or a fresh one."""
    label = getattr(request, "request_id", "")
    return label[:MAX_NAME_CHARS] if isinstance(label, str) and label else new_request_id()


async def _fail(
    frontend: Frontend, method: str, request: Any, context: grpc.aio.ServicerContext, exc: Exception
) -> None:
    """The one error boundary of the gRPC API: a ServiceError becomes its status (counted, a
    refusal logged); anything else is a bug, logged with its traceback and the request id,
    and the client gets INTERNAL naming that id (never grpcio's bare UNKNOWN)."""
    if not isinstance(exc, ServiceError):
        rid = _request_label(request)
        log.exception("grpc_internal_error", method=method, request_id=rid)
        exc = ServiceError("INTERNAL", f"internal server error (request id {rid})")
    frontend.record_failure(exc)
    await abort_with(context, exc)


def _unary(
    frontend: Frontend,
    name: str,
    method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    request_type: type[Message],
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request = await _parse(frontend, raw, request_type, context)
        try:
            return await method(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # the boundary: every RPC's errors pass here
            await _fail(frontend, name, request, context, exc)

    return handler


def _streaming(
    frontend: Frontend,
    name: str,
    method: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
    request_type: type[Message],
) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _parse(frontend, raw, request_type, context)
        try:
            async for response in method(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # the boundary, as _unary's
            await _fail(frontend, name, request, context, exc)

    return handler


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer` on `server` (instead of the generated
    `add_GenerationServiceServicer_to_server`): requests arrive as bytes and each handler
    parses its own, refusing an undecodable payload with INVALID_ARGUMENT."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        request_type, response_type = _MESSAGES[method.name]
        implementation = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(servicer.frontend, method.name, implementation, request_type),
                request_deserializer=None,
                response_serializer=response_type.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(servicer.frontend, method.name, implementation, request_type),
                request_deserializer=None,
                response_serializer=response_type.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
