"""`GenerationService`: validate, tokenize, dispatch, detokenize, stream. No torch."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from controlplane.detokenizer import IncrementalDetokenizer
from controlplane.dispatcher import Admitted, Dispatcher, GenerationRequest
from controlplane.errors import ServiceError, invalid_argument
from controlplane.tokenizer import Tokenizer
from dataplane.log import get_logger
from dataplane.server.protocol import sampling_params_from_proto
from protos.pagedserve.v1 import common_pb2, dataplane_pb2, generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

_MAX_STOP_STRINGS = 16


@dataclass
class _Completion:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    done: bool = False


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, model_name: str) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name

    # -- validation -----------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ServiceError(
                "NOT_FOUND", f"model: {model!r} is not served here (this server serves {self.model_name!r})"
            )

    def _prompt_ids(
        self, request: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest
    ) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise invalid_argument("prompt.text must not be empty")
            try:
                ids = self.tokenizer.encode(request.text)
            except ValueError as exc:
                raise invalid_argument(f"prompt.text: {exc}") from None
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise invalid_argument("prompt.chat.messages must not be empty")
            for i, m in enumerate(messages):
                if m["role"] not in ("system", "user", "assistant"):
                    raise invalid_argument(
                        f"prompt.chat.messages[{i}].role must be system, user or assistant"
                    )
            try:
                ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
            except ValueError as exc:
                raise invalid_argument(f"prompt.chat: {exc}") from None
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)  # type: ignore[union-attr]
            vocab = self._vocab_size()
            bad = [t for t in ids if vocab is not None and t >= vocab]
            if bad:
                raise invalid_argument(f"prompt.token_ids must be in [0, {vocab}), got {bad[:5]}")
        else:
            raise invalid_argument("prompt: set one of text, token_ids or chat")
        if not ids:
            raise invalid_argument("prompt: tokenizes to no tokens")
        return ids

    def _vocab_size(self) -> int | None:
        """The model's vocabulary size as the data planes reported it (else the tokenizer's)."""
        links = self.dispatcher.connections.values()
        sizes = [c.info.vocab_size for c in links if c.info is not None and c.info.vocab_size]
        return max(sizes) if sizes else (self.tokenizer.vocab_size or None)

    def _generation_request(
        self, request: generation_pb2.GenerateRequest, deadline: float | None
    ) -> GenerationRequest:
        self._check_model(request.model)
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as exc:
            raise invalid_argument(f"sampling_params.{exc}") from None
        stop = tuple(request.sampling_params.stop)
        if len(stop) > _MAX_STOP_STRINGS or any(not s for s in stop):
            raise invalid_argument(f"sampling_params.stop: at most {_MAX_STOP_STRINGS} non-empty strings")
        if len(request.request_id) > 256:
            raise invalid_argument("request_id: at most 256 characters")
        return GenerationRequest(
            request_id=request.request_id or f"req-{uuid.uuid4().hex}",
            prompt_token_ids=self._prompt_ids(request),
            sampling_params=request.sampling_params,
            num_samples=params.num_samples,
            max_tokens=params.max_tokens,
            cache_salt=request.cache_salt or None,
            deadline=deadline,
        )

    # -- RPCs -----------------------------------------------------------------------------------
    async def Generate(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GenerateRequest, generation_pb2.GenerateResponse],
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        start = time.monotonic()
        remaining = context.time_remaining()
        try:
            gen = self._generation_request(request, None if remaining is None else start + remaining)
            async for response in self._stream(gen, start):
                yield response
        except ServiceError as exc:
            await _abort(context, exc)

    async def _stream(
        self, gen: GenerationRequest, start: float
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rid = gen.request_id
        stop = tuple(gen.sampling_params.stop)
        completions = [
            _Completion(IncrementalDetokenizer(self.tokenizer, gen.prompt_token_ids, stop))
            for _ in range(gen.num_samples)
        ]
        queue_seconds = 0.0
        events = self.dispatcher.generate(gen)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Admitted):
                    queue_seconds = event.queue_seconds
                    continue
                c = completions[event.index]
                if c.done:
                    continue  # this sample already matched a stop string
                if isinstance(event, dataplane_pb2.TokenDelta):
                    c.num_tokens += len(event.token_ids)
                    c.cached_tokens = event.num_cached_tokens
                    c.first_token_time = c.first_token_time or time.monotonic()
                    text = c.detokenizer.add(list(event.token_ids))
                    yield generation_pb2.GenerateResponse(
                        request_id=rid,
                        chunk=generation_pb2.TokenChunk(
                            index=event.index, token_ids=event.token_ids, text=text, logprobs=event.logprobs
                        ),
                    )
                    if not c.detokenizer.stopped:
                        continue
                    reason = common_pb2.FINISH_REASON_STOP
                    usage = common_pb2.Usage(
                        prompt_tokens=len(gen.prompt_token_ids),
                        completion_tokens=c.num_tokens,
                        cached_tokens=c.cached_tokens,
                    )
                else:
                    tail = c.detokenizer.flush()
                    if tail:
                        yield generation_pb2.GenerateResponse(
                            request_id=rid, chunk=generation_pb2.TokenChunk(index=event.index, text=tail)
                        )
                    reason, usage = event.finish_reason, event.usage
                c.done = True
                now = time.monotonic()
                yield generation_pb2.GenerateResponse(
                    request_id=rid,
                    complete=generation_pb2.GenerateComplete(
                        index=event.index,
                        finish_reason=reason,
                        stop_string=c.detokenizer.stop_string or "",
                        usage=usage,
                        timings=generation_pb2.Timings(
                            queue_seconds=queue_seconds,
                            time_to_first_token_seconds=(c.first_token_time - start)
                            if c.first_token_time
                            else 0.0,
                            e2e_seconds=now - start,
                        ),
                    ),
                )
                if all(x.done for x in completions):
                    return  # leaving the `aclosing` block aborts what still runs on the data plane

    async def Tokenize(
        self,
        request: generation_pb2.TokenizeRequest,
        context: grpc.aio.ServicerContext[generation_pb2.TokenizeRequest, generation_pb2.TokenizeResponse],
    ) -> generation_pb2.TokenizeResponse:
        try:
            self._check_model(request.model)
            return generation_pb2.TokenizeResponse(token_ids=self._prompt_ids(request))
        except ServiceError as exc:
            await _abort(context, exc)
            raise AssertionError("unreachable") from None

    async def Detokenize(
        self,
        request: generation_pb2.DetokenizeRequest,
        context: grpc.aio.ServicerContext[
            generation_pb2.DetokenizeRequest, generation_pb2.DetokenizeResponse
        ],
    ) -> generation_pb2.DetokenizeResponse:
        try:
            self._check_model(request.model)
            vocab = self._vocab_size()
            bad = [t for t in request.token_ids if vocab is not None and t >= vocab]
            if bad:
                raise invalid_argument(f"token_ids must be in [0, {vocab}), got {bad[:5]}")
        except ServiceError as exc:
            await _abort(context, exc)
        return generation_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))

    async def ListModels(
        self,
        request: generation_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[
            generation_pb2.ListModelsRequest, generation_pb2.ListModelsResponse
        ],
    ) -> generation_pb2.ListModelsResponse:
        infos = [c.info for c in self.dispatcher.healthy if c.info is not None]
        card = generation_pb2.ModelCard(id=self.model_name)
        if infos:
            card.max_model_len = max(i.max_model_len for i in infos)
            card.block_size = infos[0].block_size
            card.kv_cache_dtype = infos[0].kv_cache_dtype
        return generation_pb2.ListModelsResponse(models=[card])


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", f"{exc.retry_after_s:g}"),))
    log.info("request_refused", code=exc.code, reason=exc.message)
    await context.abort(grpc.StatusCode[exc.code], exc.message)
