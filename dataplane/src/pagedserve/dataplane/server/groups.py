"""Request groups: one submitted request and its samples (n > 1), under typed ids.

A control plane names a request by its id on its own stream (`StreamRequestKey`); with n > 1
each completion streams under an index (`SampleId`). The engine names requests with strings
(`Request.request_id`): `GroupTable.engine_request_id` makes a request's, the engine makes its
samples' (`samples_of`), and the table maps every one back to its `SampleId`. Nothing parses
an id, so no client id can be mistaken for another's sample.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, set_span_in_context

from pagedserve.common.telemetry import extract, tracer
from pagedserve.dataplane.request import Request
from pagedserve.dataplane.server.protocol import finish_reason_to_proto
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2

_tracer = tracer(__name__)


@dataclass(frozen=True, slots=True)
class StreamRequestKey:
    """A request as its control plane named it. Ids are unique within a stream only, so two
    control-plane replicas (two streams) may use the same one."""

    stream_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class SampleId:
    """One completion of a request: the index it streams under (0 unless n > 1)."""

    key: StreamRequestKey
    index: int


@dataclass(eq=False)
class Group:
    """A submitted request while any of its samples runs, and the spans that trace it."""

    key: StreamRequestKey
    engine_id: str  # the engine's id of the request: samples_of, release and the aborts take it
    samples: list[Request]  # by completion index; the engine's own objects
    wants_logprobs: bool
    span: Span = INVALID_SPAN  # pagedserve.dataplane.request
    phase: Span = INVALID_SPAN  # pagedserve.prefill, then pagedserve.decode
    decoding: bool = False
    unfinished: set[int] = field(init=False)  # completion indexes not yet reported finished

    def __post_init__(self) -> None:
        self.unfinished = set(range(len(self.samples)))

    @classmethod
    def open(
        cls,
        key: StreamRequestKey,
        engine_id: str,
        samples: list[Request],
        wants_logprobs: bool,
        trace_context: Mapping[str, str],
        dataplane_id: str,
    ) -> Group:
        """A group whose request span (a child of the control plane's) and prefill span run."""
        span = _tracer.start_span(
            "pagedserve.dataplane.request",
            context=extract(dict(trace_context)),
            kind=SpanKind.SERVER,
            attributes={
                "pagedserve.request_id": key.request_id,
                "pagedserve.dataplane_id": dataplane_id,
                "pagedserve.prompt_tokens": samples[0].num_prompt_tokens,
                "pagedserve.num_samples": len(samples),
            },
        )
        phase = _tracer.start_span("pagedserve.prefill", context=set_span_in_context(span))
        return cls(key, engine_id, samples, wants_logprobs, span=span, phase=phase)

    def delta(self, index: int, token_ids: list[int]) -> dataplane_pb2.TokenDelta:
        """The wire delta of the tokens sample `index` took in a step (several after an
        accepted drafted run); its first token ends the prefill span."""
        request = self.samples[index]
        if not self.decoding:  # the prompt is computed: prefill ends, decode begins
            self.decoding = True
            self.phase.set_attribute("pagedserve.cached_tokens", request.num_cached_tokens)
            self.phase.end()
            self.phase = _tracer.start_span("pagedserve.decode", context=set_span_in_context(self.span))
        delta = dataplane_pb2.TokenDelta(
            request_id=self.key.request_id,
            index=index,
            token_ids=token_ids,
            num_cached_tokens=request.num_cached_tokens,
        )
        if self.wants_logprobs:
            delta.logprobs.extend(last_logprobs(request, len(token_ids)))
        if (
            index == 0
            and request.num_output_tokens == len(token_ids)
            and request.sampling_params.prompt_logprobs is not None
        ):
            delta.prompt_logprobs.extend(prompt_logprobs(request))
        return delta

    def finish(self, index: int) -> bool:
        """Mark sample `index` finished; False when it already was (report each end once)."""
        if index not in self.unfinished:
            return False
        self.unfinished.discard(index)
        return True

    @property
    def done(self) -> bool:
        return not self.unfinished

    def end_spans(self) -> None:
        samples = self.samples
        self.phase.end()
        self.span.set_attributes(
            {
                "pagedserve.completion_tokens": sum(r.num_output_tokens for r in samples),
                "pagedserve.cached_tokens": samples[0].num_cached_tokens,
                "pagedserve.num_preemptions": sum(r.num_preemptions for r in samples),
                "pagedserve.finish_reason": samples[0].status.value,
            }
        )
        self.span.end()


class GroupTable:
    """The running groups by their key, and every engine request id by its sample (loop thread)."""

    def __init__(self) -> None:
        self._groups: dict[StreamRequestKey, Group] = {}
        self._samples: dict[str, SampleId] = {}
        self._serials = itertools.count(1)

    def engine_request_id(self, key: StreamRequestKey) -> str:
        """A fresh engine id for a request of `key`: opaque, and unique by its serial even when
        a client's id looks like another request's sample id (`a` with n=2 makes `a#1`)."""
        return f"{key.stream_id}.{next(self._serials)}"

    def add(self, group: Group) -> None:
        self._groups[group.key] = group
        for index, request in enumerate(group.samples):
            self._samples[request.request_id] = SampleId(group.key, index)

    def remove(self, group: Group) -> None:
        self._groups.pop(group.key, None)
        for request in group.samples:
            self._samples.pop(request.request_id, None)

    def get(self, key: StreamRequestKey) -> Group | None:
        return self._groups.get(key)

    def sample(self, engine_request_id: str) -> SampleId | None:
        """The sample an engine request id belongs to; None once its group is gone."""
        return self._samples.get(engine_request_id)

    def of_stream(self, stream_id: str) -> list[StreamRequestKey]:
        return [key for key in self._groups if key.stream_id == stream_id]

    def __contains__(self, key: object) -> bool:
        return key in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(list(self._groups.values()))  # a copy: callers may remove as they go


def last_logprobs(request: Request, count: int) -> list[common_pb2.TokenLogprob]:
    """The wire logprobs (and top alternatives) of a request's latest `count` tokens."""
    out = []
    tops = request.output_top_logprobs
    for i in range(len(request.output_logprobs) - count, len(request.output_logprobs)):
        msg = common_pb2.TokenLogprob(logprob=request.output_logprobs[i] if i >= 0 else 0.0)
        if 0 <= i < len(tops):
            msg.top.extend(common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in tops[i])
        out.append(msg)
    return out


def prompt_logprobs(request: Request) -> list[common_pb2.PromptTokenLogprob]:
    """The wire prompt logprobs of a request: one per prompt token after the first."""
    return [
        common_pb2.PromptTokenLogprob(
            logprob=entry.logprob,
            rank=entry.rank,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top],
        )
        for entry in request.prompt_logprobs
    ]


def request_finished(sample: SampleId, request: Request) -> dataplane_pb2.RequestFinished:
    """The wire end of one sample: reason, usage and latencies since arrival at the data plane."""
    end = request.finish_time or time.monotonic()
    first = request.first_token_time
    return dataplane_pb2.RequestFinished(
        request_id=sample.key.request_id,
        index=sample.index,
        finish_reason=finish_reason_to_proto(request.status),
        usage=common_pb2.Usage(
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            spec_draft_tokens=request.num_spec_drafted,
            spec_accepted_tokens=request.num_spec_accepted,
        ),
        time_to_first_token_seconds=(first - request.arrival_time) if first else 0.0,
        e2e_seconds=end - request.arrival_time,
        num_preemptions=request.num_preemptions,
        embedding=request.embedding or (),
    )
