"""One request's stream (`Frontend.stream`): the dispatcher's token deltas turned into text
deltas and one `CompletionDone` per completion index."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from pagedserve.common.protocol import FINISH_REASON_NAMES
from pagedserve.controlplane.detokenizer import Decoder, IncrementalDetokenizer
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dispatcher import Admitted, Dispatcher
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2


@dataclass(frozen=True)
class TextDelta:
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    # sampling_params.prompt_logprobs: on completion 0's first delta, one per prompt token after the first
    prompt_logprobs: tuple[common_pb2.PromptTokenLogprob, ...] = ()


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
    # Speculative decoding: tokens drafted and verified for it, and those accepted (the data
    # plane's count; 0 for a completion the control plane stopped at a stop string).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


StreamEvent = TextDelta | CompletionDone


@dataclass
class _Completion:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False


async def completion_events(
    gen: GenerationRequest,
    start: float,
    trace_context: Mapping[str, str],
    dispatcher: Dispatcher,
    tokenizer: Decoder,
    metrics: ControlPlaneMetrics,
) -> AsyncIterator[StreamEvent]:
    """The dispatcher's events for `gen` as text deltas (detokenized, stop strings applied) and
    one `CompletionDone` per index, with the request's metrics recorded on the way."""
    completions = [_Completion(gen.detokenizer(tokenizer)) for _ in range(gen.num_samples)]
    queue_seconds = 0.0
    events = dispatcher.generate(gen, trace_context)
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
                yield TextDelta(
                    event.index,
                    tuple(event.token_ids),
                    text,
                    tuple(event.logprobs),
                    tuple(event.prompt_logprobs),
                )
                if not c.detokenizer.stopped:
                    continue
                reason, completion_tokens, cached = "stop", c.num_tokens, c.cached_tokens
                spec = (0, 0)
                if sum(not x.done for x in completions) > 1:
                    # Its siblings run on: stop this one on the data plane too (its blocks
                    # come back now, not at the group's end). The last one needs no abort:
                    # leaving the loop below aborts the whole request.
                    dispatcher.abort_sample(gen.request_id, event.index)
            else:
                tail = c.detokenizer.flush()
                if tail:
                    yield TextDelta(event.index, (), tail)
                reason = FINISH_REASON_NAMES.get(event.finish_reason, "abort")
                completion_tokens, cached = event.usage.completion_tokens, event.usage.cached_tokens
                spec = (event.usage.spec_draft_tokens, event.usage.spec_accepted_tokens)
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
                spec_draft_tokens=spec[0],
                spec_accepted_tokens=spec[1],
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
