"""What every client-facing API shares: prompt handling, validation and the per-request stream.

The gRPC `GenerationService` and the OpenAI HTTP routes both turn what a client sent into a
`GenerationRequest` with `Frontend.validate` (the one validation of a request) and consume
`Frontend.stream()`: text deltas (detokenized incrementally, stop strings applied) and one
`CompletionDone` per completion index. Transport-specific framing stays in the servicer and
the HTTP routes. No torch.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from controlplane.detokenizer import IncrementalDetokenizer
from controlplane.dispatcher import Admitted, Dispatcher
from controlplane.errors import ServiceError, invalid_argument
from controlplane.metrics import ControlPlaneMetrics
from controlplane.placement import NO_DATAPLANE
from controlplane.request import GenerationRequest
from controlplane.tokenizer import Tokenizer
from pagedserve.common.log import get_logger
from pagedserve.common.protocol import FINISH_REASON_NAMES, sampling_params_from_fields
from pagedserve.common.telemetry import inject, span_ids, tracer
from protos.pagedserve.v1 import common_pb2, dataplane_pb2

log = get_logger(__name__)
_tracer = tracer(__name__)

MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class TextDelta:
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class CompletionDone:
    index: int
    finish_reason: str  # "stop" | "length" | "abort"
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    e2e_seconds: float


StreamEvent = TextDelta | CompletionDone


@dataclass(frozen=True)
class ModelCard:
    """A served model name and, once a data plane has reported, how it is served."""

    id: str
    max_model_len: int | None
    block_size: int | None
    kv_cache_dtype: str | None


@dataclass
class _Completion:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False


class Frontend:
    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: ControlPlaneMetrics | None = None,
        served_model_names: tuple[str, ...] = (),
    ) -> None:
        """`served_model_names` (vLLM's --served-model-name): the names clients may use; the
        first is the one responses report. Default: the model's own name."""
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names or (model_name,)
        self.model_name = self.served_model_names[0]
        self.metrics = metrics if metrics is not None else ControlPlaneMetrics(dispatcher)

    # -- validation -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model not in self.served_model_names:
            served = ", ".join(repr(n) for n in self.served_model_names)
            raise ServiceError(
                "NOT_FOUND", f"model: {model!r} is not served here (this server serves {served})"
            )

    def vocab_size(self) -> int | None:
        """The model's vocabulary size as the data planes reported it (else the tokenizer's)."""
        links = self.dispatcher.connections.values()
        sizes = [c.info.vocab_size for c in links if c.info is not None and c.info.vocab_size]
        return max(sizes) if sizes else (self.tokenizer.vocab_size or None)

    def max_model_len(self) -> int | None:
        """The model's context as the data planes reported it (the longest); None before any has."""
        links = self.dispatcher.connections.values()
        return max((c.info.max_model_len for c in links if c.info is not None), default=None)

    def model_cards(self) -> list[ModelCard]:
        """What ListModels (gRPC) and /v1/models (HTTP) report: one card per served name, with
        the healthy data planes' context, block size and KV dtype once one has reported."""
        infos = [c.info for c in self.dispatcher.healthy if c.info is not None]
        return [
            ModelCard(
                name,
                max(i.max_model_len for i in infos) if infos else None,
                infos[0].block_size if infos else None,
                infos[0].kv_cache_dtype if infos else None,
            )
            for name in self.served_model_names
        ]

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """max_tokens of a request that leaves it unset: the rest of the model's context.

        The context a data plane can give one sequence is its max_model_len or, when its KV
        pool is smaller, what the pool holds: a small pool then bounds the default instead of
        refusing a request for a max_tokens the client never sent. At least 1, so that a
        prompt that fills the context is refused for its length (by admission).
        """
        infos = [c.info for c in self.dispatcher.connections.values() if c.info is not None]
        if not infos:  # no data plane has ever connected: nothing could run it anyway
            raise ServiceError("UNAVAILABLE", NO_DATAPLANE)
        context = max(min(i.max_model_len, i.num_blocks * i.block_size) for i in infos)
        return max(1, context - prompt_tokens)

    def encode_text(self, text: str, field_name: str = "prompt.text") -> list[int]:
        if not text:
            raise invalid_argument(f"{field_name} must not be empty")
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise invalid_argument(f"{field_name}: {exc}") from None

    def encode_chat(
        self, messages: Sequence[dict[str, str]], field_name: str = "prompt.chat.messages"
    ) -> list[int]:
        if not messages:
            raise invalid_argument(f"{field_name} must not be empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise invalid_argument(f"{field_name}[{i}].role must be one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise invalid_argument(f"{field_name}[{i}].content must be a string")
        try:
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(messages)))
        except ValueError as exc:
            raise invalid_argument(f"{field_name}: {exc}") from None

    def check_token_ids(self, ids: Sequence[int], field_name: str = "prompt.token_ids") -> list[int]:
        vocab = self.vocab_size()
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise invalid_argument(f"{field_name} must be in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise invalid_argument(f"{field_name} must not be empty")
        return list(ids)

    def validate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Mapping[str, object],
        stop: Sequence[str] = (),
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        deadline: float | None = None,
        field_prefix: str = "sampling_params.",
    ) -> GenerationRequest:
        """The one validation of a request, whichever API it came through.

        `sampling`: the sampling fields the client set, named as SamplingParams names them
        (an unset max_tokens means the rest of the context); `stop`: its stop strings.
        Raises INVALID_ARGUMENT naming the bad field, prefixed with `field_prefix` (the gRPC
        message nests them under `sampling_params`, an OpenAI body does not).
        """
        values = dict(sampling)
        if values.get("max_tokens") is None:
            values["max_tokens"] = self.default_max_tokens(len(prompt_token_ids))
        try:
            params = sampling_params_from_fields(values)
        except ValueError as exc:
            raise invalid_argument(f"{field_prefix}{exc}") from None
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise invalid_argument(f"{field_prefix}stop: at most {MAX_STOP_STRINGS} non-empty strings")
        if request_id is not None and len(request_id) > 256:
            raise invalid_argument("request_id: at most 256 characters")
        if not prompt_token_ids:
            raise invalid_argument("prompt: tokenizes to no tokens")
        return GenerationRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            stop=tuple(stop),
            cache_salt=cache_salt or None,
            deadline=deadline,
        )

    # -- the stream -----------------------------------------------------------------------------
    async def stream(
        self, gen: GenerationRequest, start: float | None = None, parent: otel_context.Context | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Text deltas and one CompletionDone per index; raises ServiceError. Leaving early
        (or being cancelled) aborts what still runs on the data plane.

        The whole request is one span (`pagedserve.request`, a child of the client's trace
        context `parent` if it sent one); the admission, the data plane's prefill and decode
        are its children, the latter across the internal gRPC stream.
        """
        start = time.monotonic() if start is None else start
        attributes: dict[str, str | int] = {
            "pagedserve.request_id": gen.request_id,
            "pagedserve.prompt_tokens": gen.num_prompt_tokens,
            "pagedserve.max_tokens": gen.max_tokens,
            "pagedserve.num_samples": gen.num_samples,
            "gen_ai.request.model": self.model_name,
        }
        # No context attach here: an async generator may be finalized in another context, so
        # the span is passed explicitly (to the data plane as a trace context, to logs by id).
        span = _tracer.start_span(
            "pagedserve.request", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        trace_context = inject(set_span_in_context(span))
        ids = span_ids(span)
        try:
            async for event in self._stream(gen, start, trace_context):
                if isinstance(event, CompletionDone):
                    span.set_attribute(
                        f"pagedserve.completion.{event.index}.finish_reason", event.finish_reason
                    )
                    span.set_attribute(f"pagedserve.completion.{event.index}.tokens", event.completion_tokens)
                    log.info(
                        "request_finished",
                        request_id=gen.request_id,
                        index=event.index,
                        finish_reason=event.finish_reason,
                        prompt_tokens=event.prompt_tokens,
                        cached_tokens=event.cached_tokens,
                        completion_tokens=event.completion_tokens,
                        ttft_s=round(event.time_to_first_token_seconds, 4),
                        e2e_s=round(event.e2e_seconds, 4),
                        **ids,
                    )
                yield event
        except ServiceError as exc:
            self.record_failure(exc)
            span.set_status(Status(StatusCode.ERROR, exc.code))
            log.info("request_failed", request_id=gen.request_id, code=exc.code, reason=exc.message, **ids)
            raise
        finally:
            span.end()

    def record_failure(self, exc: ServiceError) -> None:
        """Count a refused or failed request once, whichever layer saw it first."""
        if not exc.counted:
            exc.counted = True
            self.metrics.failure(exc.code)

    async def _stream(
        self, gen: GenerationRequest, start: float, trace_context: Mapping[str, str]
    ) -> AsyncIterator[StreamEvent]:
        metrics = self.metrics
        prompt = list(gen.prompt_token_ids)
        completions = [
            _Completion(IncrementalDetokenizer(self.tokenizer, prompt, gen.stop))
            for _ in range(gen.num_samples)
        ]
        queue_seconds = 0.0
        events = self.dispatcher.generate(gen, trace_context)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Admitted):
                    queue_seconds = event.queue_seconds
                    metrics.queue_time.observe(queue_seconds)
                    continue
                c = completions[event.index]
                if c.done:
                    continue  # this sample already matched a stop string
                if isinstance(event, dataplane_pb2.TokenDelta):
                    now = time.monotonic()
                    c.num_tokens += len(event.token_ids)
                    c.cached_tokens = event.num_cached_tokens
                    c.first_token_time = c.first_token_time or now
                    if c.last_token_time is not None:
                        metrics.itl.observe(now - c.last_token_time)
                    c.last_token_time = now
                    metrics.generation_tokens.inc(len(event.token_ids))
                    text = c.detokenizer.add(list(event.token_ids))
                    yield TextDelta(event.index, tuple(event.token_ids), text, tuple(event.logprobs))
                    if not c.detokenizer.stopped:
                        continue
                    reason, completion_tokens, cached = "stop", c.num_tokens, c.cached_tokens
                else:
                    tail = c.detokenizer.flush()
                    if tail:
                        yield TextDelta(event.index, (), tail)
                    reason = FINISH_REASON_NAMES.get(event.finish_reason, "abort")
                    completion_tokens, cached = event.usage.completion_tokens, event.usage.cached_tokens
                first_of_request = not any(x.done for x in completions)
                c.done = True
                done = CompletionDone(
                    index=event.index,
                    finish_reason=reason,
                    stop_string=c.detokenizer.stop_string,
                    prompt_tokens=gen.num_prompt_tokens,
                    completion_tokens=completion_tokens,
                    cached_tokens=cached,
                    queue_seconds=queue_seconds,
                    time_to_first_token_seconds=(c.first_token_time - start) if c.first_token_time else 0.0,
                    e2e_seconds=time.monotonic() - start,
                )
                metrics.completion(
                    reason,
                    done.prompt_tokens,
                    completion_tokens,
                    done.time_to_first_token_seconds,
                    done.e2e_seconds,
                    first_of_request,
                )
                yield done
                if all(x.done for x in completions):
                    return  # leaving the `aclosing` block aborts what still runs on the data plane
