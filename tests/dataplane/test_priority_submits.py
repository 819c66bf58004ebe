"""`SubmitCommand.priority` on the data plane without a model: the engine loop gives every
sample of a request its priority, refuses one out of range INVALID_ARGUMENT naming the field,
and the priority- and fair-share-preemption counters reach Prometheus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedserve.common.priority import MAX_PRIORITY, MIN_PRIORITY
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.scheduler import Scheduler
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.metrics import fair_share_preemptions, priority_preemptions
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2
from tests.dataplane.test_engine_loop import FakeEngine, Sink, engine, loop, settle

__all__ = ["engine", "loop"]  # the fixtures, used by name


def submit(
    loop: EngineLoop, stream: str, request_id: str, priority: int = 0, n: int = 1, **fields: Any
) -> None:
    """A 3-token submit of `n` samples; `fields`: more SubmitCommand fields (tenant, ...)."""
    loop.submit(
        stream,
        dataplane_pb2.SubmitCommand(
            request_id=request_id,
            prompt_token_ids=[1, 2, 3],
            sampling_params=common_pb2.SamplingParams(max_tokens=4, n=n),
            priority=priority,
            **fields,
        ),
    )


def test_every_sample_gets_the_priority_and_bounds_are_checked(loop: EngineLoop, engine: FakeEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "urgent", -5, n=3)
    submit(loop, stream, "default", 0)
    submit(loop, stream, "lowest", MAX_PRIORITY)
    submit(loop, stream, "too-low", MIN_PRIORITY - 1)
    submit(loop, stream, "too-high", MAX_PRIORITY + 1)
    settle(loop)
    assert [s.priority for s in engine.samples_of("s1.1")] == [-5, -5, -5]
    assert [s.priority for s in engine.samples_of("s1.2")] == [0]
    assert [s.priority for s in engine.samples_of("s1.3")] == [MAX_PRIORITY]
    assert sink.rejected() == [("too-low", "INVALID_ARGUMENT"), ("too-high", "INVALID_ARGUMENT")]
    messages = [r.message for m in sink.messages if m for r in m.rejected]
    assert all(m.startswith("priority must be in [-1000000, 1000000]") for m in messages), messages
    assert engine.added == ["s1.1", "s1.2", "s1.3"]


@pytest.mark.parametrize(
    ("metric", "attribute", "reader"),
    [
        ("pagedserve_num_priority_preemptions_total", "num_priority_preemptions", priority_preemptions),
        ("pagedserve_num_fair_share_preemptions_total", "num_fair_share_preemptions", fair_share_preemptions),
    ],
)
def test_the_preemption_counters_are_scraped(
    loop: EngineLoop, metric: str, attribute: str, reader: Callable[[Any], Callable[[], int]]
) -> None:
    assert loop.metrics.registry.get_sample_value(metric) == 0.0  # the fake engine has no scheduler: 0
    scheduler = Scheduler(
        KVCacheManager(BlockPool(4), 4), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), 64
    )
    setattr(scheduler, attribute, 3)

    class Engine:
        pass

    real = Engine()
    real.scheduler = scheduler  # type: ignore[attr-defined]
    assert reader(real)() == 3
