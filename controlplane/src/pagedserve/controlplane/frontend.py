"""What every client-facing API shares: prompt handling, validation and the per-request stream.

The gRPC `GenerationService` and the OpenAI HTTP routes both turn what a client sent into a
`GenerationRequest` with `Frontend.validate` (the one validation of a request) and consume
`Frontend.stream()`: text deltas (detokenized incrementally, stop strings applied) and one
`CompletionDone` per completion index. Transport-specific framing stays in the servicer and
the HTTP routes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from pagedserve.common.admission_rules import beyond_context
from pagedserve.common.log import get_logger
from pagedserve.common.priority import PRIORITY_FIELD, priority_refusal
from pagedserve.common.protocol import sampling_params_from_fields
from pagedserve.common.sampling_params import InvalidField
from pagedserve.common.telemetry import inject, span_ids, tracer
from pagedserve.controlplane.bad_words import bad_words_token_ids
from pagedserve.controlplane.deadlines import request_deadline
from pagedserve.controlplane.errors import ServiceError, clip, invalid_argument, named_error
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.refusals import RefusalLog
from pagedserve.controlplane.request import GenerationRequest, new_request_id, truncated_prompt
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.routing.placement import NO_DATAPLANE
from pagedserve.controlplane.stream_events import CompletionDone as CompletionDone
from pagedserve.controlplane.stream_events import StreamEvent as StreamEvent
from pagedserve.controlplane.stream_events import TextDelta as TextDelta
from pagedserve.controlplane.stream_events import completion_events
from pagedserve.controlplane.tenancy.auth import request_tenant, tenant_salt
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.controlplane.tools.definitions import NO_TOOLS, ToolUse
from pagedserve.controlplane.tools.prompt import resolve_parser, template_inputs

log = get_logger(__name__)
_tracer = tracer(__name__)

# Limits of one request, the same over gRPC and HTTP: whatever a client sends, the work and the
# memory one request can cause are bounded before any per-request state is built.
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_STRING_CHARS = 256  # characters per stop string (the detokenizer holds back that many)
MAX_PROMPT_CHARS = 1 << 20  # characters of a text prompt, or of a chat's contents in all
MAX_NAME_CHARS = 256  # a model name, a client's request id, a cache salt
MAX_PROMPTS = 256  # prompts in one HTTP completions request
MAX_CHOICES = 1024  # completions in one HTTP completions request (prompts × n)
# n (and best_of): at most sampling_params.MAX_NUM_SAMPLES (128), enforced by SamplingParams.
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def check_text(value: str, field_name: str, limit: int) -> None:
    """A client's string: at most `limit` characters and valid Unicode (no lone surrogate,
    which JSON can carry but no tokenizer or protobuf accepts); INVALID_ARGUMENT otherwise."""
    if len(value) > limit:
        raise invalid_argument(f"{field_name}: at most {limit} characters", field_name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_argument(
            f"{field_name}: not valid Unicode (a lone surrogate at character {exc.start})", field_name
        ) from None


@dataclass(frozen=True)
class ModelCard:
    """A served model name and, once a data plane has reported, how it is served."""

    id: str
    max_model_len: int | None
    block_size: int | None
    kv_cache_dtype: str | None


class Frontend:
    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: ControlPlaneMetrics | None = None,
        served_model_names: tuple[str, ...] = (),
        tool_call_parser: str = "auto",
        request_timeout_s: float | None = None,
        model_aliases: tuple[str, ...] = (),
        reasoning_parser: str = "none",
    ) -> None:
        """`served_model_names` (vLLM's --served-model-name): the names clients may use; the
        first is the one responses report. Default: the model's own name. `model_aliases`:
        names also accepted, never listed (a local model's path). `tool_call_parser`:
        the format the model writes tool calls in (`auto`: read from its chat template).
        `request_timeout_s`: the server's default deadline (controlplane/src/pagedserve/controlplane/deadlines.py).
        `reasoning_parser`: how the HTTP chat answers' reasoning section is split out
        (controlplane/src/pagedserve/controlplane/reasoning.py; "none": not at all)."""
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names or (model_name,)
        self.model_name = self.served_model_names[0]
        self.model_aliases = model_aliases
        self.metrics = metrics if metrics is not None else ControlPlaneMetrics(dispatcher)
        self.refusals = RefusalLog()
        self.tool_call_format = resolve_parser(tool_call_parser, tokenizer.chat_template)
        self.request_timeout_s = request_timeout_s
        self.reasoning_parser = reasoning_parser

    # -- validation -----------------------------------------------------------------------------
    def check_model(self, model: str | None, field_name: str = "model") -> None:
        """None (omitted; gRPC sends "" for that) means the served model, as in vLLM."""
        if model is None:
            return
        if not model:
            raise invalid_argument(
                f"{field_name} must not be empty (omit it for the served model)", field_name
            )
        if len(model) > MAX_NAME_CHARS:  # never echoed: it could fill a gRPC status or a log line
            raise invalid_argument(f"{field_name}: at most {MAX_NAME_CHARS} characters", field_name)
        if model not in self.served_model_names and model not in self.model_aliases:
            served = ", ".join(repr(n) for n in self.served_model_names)
            raise ServiceError(
                "NOT_FOUND",
                f"{field_name}: {model!r} is not served here (this server serves {served})",
                param=field_name,
            )

    def check_batch(self, num_prompts: int, n: int, field_name: str = "prompt") -> None:
        """One HTTP completions call may carry several prompts: at most MAX_PROMPTS, and at
        most MAX_CHOICES completions in all (prompts × n), checked before any is validated."""
        if num_prompts > MAX_PROMPTS:
            raise invalid_argument(f"{field_name}: at most {MAX_PROMPTS} prompts per request", field_name)
        if num_prompts > 1 and num_prompts * n > MAX_CHOICES:  # one prompt: n's own bound
            raise invalid_argument(
                f"n: {num_prompts} prompts × n={n} asks for {num_prompts * n} completions, "
                f"at most {MAX_CHOICES} per request",
                "n",
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
            raise invalid_argument(f"{field_name} must not be empty", field_name)
        check_text(text, field_name, MAX_PROMPT_CHARS)
        return self._encode(text, field_name)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        field_name: str = "prompt.chat.messages",
        add_generation_prompt: bool = True,
        tool_use: ToolUse = NO_TOOLS,
    ) -> list[int]:
        text = self.render_chat(messages, field_name, add_generation_prompt, tool_use)
        return self._encode(text, field_name)

    def _encode(self, text: str, field_name: str) -> list[int]:
        """Token ids of `text`; a tokenizer's complaint is the client's error, naming the field."""
        try:
            return self.tokenizer.encode(text)
        except (ValueError, TypeError) as exc:
            raise invalid_argument(f"{field_name}: {exc}", field_name) from None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        field_name: str = "prompt.chat.messages",
        add_generation_prompt: bool = True,
        tool_use: ToolUse = NO_TOOLS,
    ) -> str:
        """The chat rendered with the model's template (generation prompt appended), with the
        request's tools (pagedserve.controlplane.tools.prompt says how). Earlier tool calls' arguments
        count toward the conversation's size limit."""
        if not messages:
            raise invalid_argument(f"{field_name} must not be empty", field_name)
        total = 0
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                name = f"{field_name}[{i}].role"
                raise invalid_argument(f"{name} must be one of {', '.join(CHAT_ROLES)}", name)
            content = m.get("content")
            if not isinstance(content, str):
                name = f"{field_name}[{i}].content"
                raise invalid_argument(f"{name} must be a string", name)
            check_text(content, f"{field_name}[{i}].content", MAX_PROMPT_CHARS)
            total += len(content) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls") or ())
        if total > MAX_PROMPT_CHARS:
            raise invalid_argument(f"{field_name}: at most {MAX_PROMPT_CHARS} characters in all", field_name)
        inputs, tools = template_inputs(messages, tool_use, self.tokenizer.chat_template)
        try:
            return self.tokenizer.apply_chat_template(inputs, add_generation_prompt, tools)
        except (ValueError, TypeError) as exc:
            raise invalid_argument(f"{field_name}: {exc}", field_name) from None

    def check_token_ids(self, ids: Sequence[int], field_name: str = "prompt.token_ids") -> list[int]:
        vocab = self.vocab_size()
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise invalid_argument(f"{field_name} must be in [0, {vocab}), got {bad[:5]}", field_name)
        if not ids:
            raise invalid_argument(f"{field_name} must not be empty", field_name)
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
        timeout_s: float | None = None,
        priority: int | None = None,
        include_stop_str_in_output: bool = False,
        truncate_prompt_tokens: int | None = None,
        bad_words: Sequence[object] = (),
        field_prefix: str = "sampling_params.",
        field_names: Mapping[str, str] | None = None,
        request_id_field: str = "request_id",
    ) -> GenerationRequest:
        """The one validation of a request, whichever API it came through.

        `sampling`: the sampling fields the client set, named as SamplingParams names them
        (an unset max_tokens means the rest of the context); `stop`: its stop strings.
        Raises INVALID_ARGUMENT naming the bad field as the client named it: prefixed with
        `field_prefix` (the gRPC message nests them under `sampling_params`, an OpenAI body
        does not) and renamed by `field_names` (e.g. max_tokens -> max_completion_tokens).

        Every value is range-checked on its Python value, against what the engine accepts
        and what its wire field holds, before anything is converted or built for it (the
        per-sample state is made only for a validated `n`). `request_id` is the client's
        label (`request_id_field` names where it came from); the request is keyed by a fresh
        server id. Its deadline: the soonest of `deadline` (the call's), the client's `timeout_s`
        and the server's default. `priority`: lower is scheduled earlier (None: 0). vLLM's
        `truncate_prompt_tokens` keeps only the prompt's last tokens, before anything else.
        """
        names = field_names or {}

        def field(name: str) -> str:
            return f"{field_prefix}{names.get(name, name)}"

        prompt_token_ids = truncated_prompt(
            prompt_token_ids, truncate_prompt_tokens, field("truncate_prompt_tokens")
        )

        due = request_deadline(deadline, timeout_s, self.request_timeout_s)
        if request_id is not None:
            check_text(request_id, request_id_field, MAX_NAME_CHARS)
        if cache_salt is not None:
            check_text(cache_salt, "cache_salt", MAX_NAME_CHARS)
        refused = None if priority is None else priority_refusal(priority)
        if refused is not None:
            raise invalid_argument(refused, PRIORITY_FIELD)
        # The authenticated tenant (API keys on) namespaces the salt: no tenant can ever share
        # another's cached blocks, whatever salt it sends.
        salt = tenant_salt(request_tenant(), cache_salt)
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise invalid_argument(
                f"{field('stop')}: at most {MAX_STOP_STRINGS} non-empty strings", field("stop")
            )
        for i, s in enumerate(stop):
            check_text(s, f"{field('stop')}[{i}]", MAX_STOP_STRING_CHARS)
        values = dict(sampling)
        if bad_words:  # vLLM's: tokenized here, masked by the data plane's sampler
            values["bad_words_token_ids"] = bad_words_token_ids(
                self.tokenizer.encode, bad_words, field("bad_words")
            )
        explicit_max_tokens = values.get("max_tokens") is not None
        if not explicit_max_tokens:
            values["max_tokens"] = self.default_max_tokens(len(prompt_token_ids))
        try:
            params = sampling_params_from_fields(values)
        except InvalidField as exc:  # (a reason echoes the value: clipped, an int may have 4000 digits)
            raise invalid_argument(f"{field(exc.field)} {clip(exc.reason, 200)}", field(exc.field)) from None
        except ValueError as exc:
            raise invalid_argument(f"{field_prefix}{exc}") from None
        vocab = self.vocab_size()
        if params.logit_bias and vocab is not None:
            bad = [t for t, _ in params.logit_bias if t >= vocab]
            if bad:
                name = field("logit_bias")
                raise invalid_argument(f"{name} keys must be token ids in [0, {vocab}), got {bad[:5]}", name)
        if params.allowed_token_ids and vocab is not None and params.allowed_token_ids[-1] >= vocab:
            name = field("allowed_token_ids")
            raise invalid_argument(f"{name} must be token ids in [0, {vocab})", name)
        if not prompt_token_ids:
            raise invalid_argument("prompt: tokenizes to no tokens")
        context = self.max_model_len()
        if explicit_max_tokens and context is not None:
            too_large = beyond_context(len(prompt_token_ids), params.max_tokens, context, field("max_tokens"))
            if too_large is not None:
                raise invalid_argument(too_large, field("max_tokens"))
        return GenerationRequest(
            request_id=new_request_id(),
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            stop=tuple(stop),
            include_stop_str_in_output=include_stop_str_in_output,
            cache_salt=salt,
            deadline=None if due is None else due.at,
            deadline_source="" if due is None else due.source,
            deadline_param=None if due is None else due.param,
            client_request_id=request_id or "",
            constraint_field=field(params.constraint.kind) if params.constraint is not None else "",
            priority=priority or 0,
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
            "pagedserve.request_id": gen.label,
            "pagedserve.internal_request_id": gen.request_id,
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
            async for event in completion_events(
                gen, start, trace_context, self.dispatcher, self.tokenizer, self.metrics
            ):
                if isinstance(event, CompletionDone):
                    span.set_attribute(
                        f"pagedserve.completion.{event.index}.finish_reason", event.finish_reason
                    )
                    span.set_attribute(f"pagedserve.completion.{event.index}.tokens", event.completion_tokens)
                    log.info(
                        "request_finished",
                        request_id=gen.label,
                        internal_request_id=gen.request_id,
                        tenant=gen.tenant,
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
            exc = named_error(gen, exc)
            self.record_failure(exc, gen.label)
            span.set_status(Status(StatusCode.ERROR, exc.code))
            raise exc from None
        finally:
            span.end()

    def record_failure(self, exc: ServiceError, request_id: str | None = None) -> None:
        """Count and log a refused or failed request once, whichever layer saw it first (the
        log rate-limited by reason: a burst of refusals is a few lines, the count exact)."""
        if not exc.counted:
            exc.counted = True
            self.metrics.failure(exc.code)
            self.refusals.note(exc, request_id)
