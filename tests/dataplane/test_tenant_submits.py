"""`SubmitCommand.tenant` / `tenant_weight` on the data plane without a model: the engine loop
gives every sample of a request its tenant and weight (0 on the wire: 1), refuses a name or a
weight out of bounds INVALID_ARGUMENT naming the field. (Its preemption counter:
tests/dataplane/test_priority_submits.py.)"""

from __future__ import annotations

from pagedserve.common.tenant_share import MAX_TENANT_LEN, MAX_TENANT_WEIGHT
from pagedserve.dataplane.server.engine_loop import EngineLoop
from tests.dataplane.test_engine_loop import FakeEngine, Sink, engine, loop, settle
from tests.dataplane.test_priority_submits import submit as submit_fields

__all__ = ["engine", "loop"]  # the fixtures, used by name


def submit(loop: EngineLoop, stream: str, request_id: str, tenant: str, weight: float, n: int = 1) -> None:
    submit_fields(loop, stream, request_id, n=n, tenant=tenant, tenant_weight=weight)


def test_every_sample_gets_the_tenant_and_bounds_are_checked(loop: EngineLoop, engine: FakeEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "a", "tenant-a", 2.5, n=3)
    submit(loop, stream, "unset", "", 0.0)
    submit(loop, stream, "longest", "t" * MAX_TENANT_LEN, MAX_TENANT_WEIGHT)
    submit(loop, stream, "long-name", "t" * (MAX_TENANT_LEN + 1), 1.0)
    submit(loop, stream, "negative", "b", -1.0)
    submit(loop, stream, "huge", "b", MAX_TENANT_WEIGHT * 2)
    submit(loop, stream, "nan", "b", float("nan"))
    settle(loop)
    assert [(s.tenant, s.tenant_weight) for s in engine.samples_of("s1.1")] == [("tenant-a", 2.5)] * 3
    assert [(s.tenant, s.tenant_weight) for s in engine.samples_of("s1.2")] == [("", 1.0)]
    assert [s.tenant_weight for s in engine.samples_of("s1.3")] == [MAX_TENANT_WEIGHT]
    assert sink.rejected() == [(rid, "INVALID_ARGUMENT") for rid in ("long-name", "negative", "huge", "nan")]
    messages = [r.message for m in sink.messages if m for r in m.rejected]
    assert messages[0] == f"tenant must be at most {MAX_TENANT_LEN} characters, got {MAX_TENANT_LEN + 1}"
    assert all(m.startswith("tenant_weight must be in (0, 1e+06]") for m in messages[1:]), messages
    assert engine.added == ["s1.1", "s1.2", "s1.3"]
