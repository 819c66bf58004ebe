"""Per-tenant limits and their configuration: max_concurrency and tokens_per_minute refuse with
RESOURCE_EXHAUSTED and a retry hint; a request's slot and its unused tokens come back however
it ends (finished, cancelled, failed), checked through the Dispatcher over a fake data plane;
the keys file's tenant settings parse, and a bad one is named with its place."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.routing.router import MIN_PENDING, Candidate, share_slots
from pagedserve.controlplane.tenancy.auth import load_keys, load_tenant_settings, read_keys_file
from pagedserve.controlplane.tenancy.tenant_limits import TenantLimits
from pagedserve.controlplane.tenancy.tenants import DEFAULT_TENANT, TenantPolicy
from pagedserve.protos.pagedserve.v1 import dataplane_pb2
from tests.controlplane.test_dataplane_link_drain import FakeDataPlane, wait_for, with_fake_dataplane


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- limits ---------------------------------------------------------------------------------------
def test_max_concurrency_refuses_with_a_retry_hint_until_a_slot_comes_back() -> None:
    limits = TenantLimits({"a": TenantPolicy(max_concurrency=2), "b": TenantPolicy()})
    first, _ = limits.acquire("a", 10, 20), limits.acquire("a", 10, 20)
    with pytest.raises(ServiceError) as refused:
        limits.acquire("a", 10, 20)
    assert refused.value.code == "RESOURCE_EXHAUSTED" and refused.value.http_status == 429
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert "tenant a has 2 requests in progress" in refused.value.message
    assert "max_concurrency 2" in refused.value.message
    assert limits.refused[("a", "max_concurrency")] == 1
    for _ in range(5):
        limits.acquire("b", 10, 20)  # another tenant is not limited by a's
    limits.release(first)
    limits.release(first)  # twice: still one slot
    assert limits.in_progress["a"] == 1
    limits.acquire("a", 10, 20)
    assert limits.in_progress["a"] == 2


def test_tokens_per_minute_is_a_bucket_with_an_exact_hint_and_refunds() -> None:
    clock = Clock()
    limits = TenantLimits({"a": TenantPolicy(tokens_per_minute=600)}, clock)  # 10 tokens/s
    lease = limits.acquire("a", prompt_tokens=100, charged=500)  # 100 left
    with pytest.raises(ServiceError) as refused:
        limits.acquire("a", 50, 200)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert refused.value.retry_after_s == 10.0  # (200 - 100) / 10 tokens a second
    assert "tokens_per_minute 600" in refused.value.message and "counts 200 tokens" in refused.value.message
    assert limits.refused[("a", "tokens_per_minute")] == 1
    lease.admitted, lease.generated = True, 100  # of the 400 it might have generated: 300 come back
    limits.release(lease)
    limits.acquire("a", 50, 400)  # 100 + 300 = 400 in the bucket
    clock.now += 6.0
    with pytest.raises(ServiceError):
        limits.acquire("a", 50, 100)  # 60 refilled
    clock.now += 4.0
    limits.acquire("a", 50, 100)


def test_a_request_never_admitted_gives_all_its_tokens_back() -> None:
    limits = TenantLimits({"a": TenantPolicy(tokens_per_minute=600)}, Clock())
    lease = limits.acquire("a", prompt_tokens=100, charged=600)
    limits.release(lease)  # refused by a full queue, or past its deadline while queued
    limits.acquire("a", 100, 600)  # the bucket is full again


def test_a_request_larger_than_the_bucket_goes_when_the_bucket_is_full() -> None:
    clock = Clock()
    limits = TenantLimits({"a": TenantPolicy(tokens_per_minute=60)}, clock)
    limits.acquire("a", 10, 1000)  # never refused for ever: it leaves the bucket in debt
    with pytest.raises(ServiceError) as refused:
        limits.acquire("a", 1, 1)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 60


# -- the keys file --------------------------------------------------------------------------------
def test_settings_lines_in_the_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(
        "alpha: k1\nalpha: k2\nbravo: k3\nsolo-key\n"
        "alpha weight=3 max_concurrency=8  # the big customer\n"
        "* tokens_per_minute=60000\n"
    )
    assert read_keys_file(keys) == [("k1", "alpha"), ("k2", "alpha"), ("k3", "bravo"), ("solo-key", None)]
    settings = load_tenant_settings(keys)
    assert settings == (
        ("alpha", TenantPolicy(weight=3.0, max_concurrency=8)),
        ("*", TenantPolicy(tokens_per_minute=60000)),
    )
    api_keys, tenants = load_keys((), keys)
    config = ControlPlaneConfig(
        dataplanes=("h:1",), api_keys=api_keys, api_key_tenants=tenants, tenant_settings=settings
    )
    dispatcher = Dispatcher(config)
    policies = dispatcher.tenants.policies
    assert policies["alpha"] == TenantPolicy(weight=3.0, max_concurrency=8)
    assert policies["bravo"] == TenantPolicy(tokens_per_minute=60000)  # the `*` line
    assert len(policies) == 3  # alpha, bravo and solo-key's own tenant
    assert dispatcher.admission.weights["alpha"] == 3.0


def test_settings_objects_in_a_json_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    data = {
        "alpha": {"keys": ["k1", "k2"], "weight": 2, "max_concurrency": 4},
        "bravo": "k3",
        "*": {"weight": 0.5},
    }
    keys.write_text(json.dumps(data))
    assert read_keys_file(keys) == [("k1", "alpha"), ("k2", "alpha"), ("k3", "bravo")]
    assert load_tenant_settings(keys) == (
        ("alpha", TenantPolicy(weight=2.0, max_concurrency=4)),
        ("*", TenantPolicy(weight=0.5)),
    )
    assert load_tenant_settings(None) == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: k1\na wieght=2\n", "keys:2: unknown tenant setting 'wieght' (known: weight, max_concurrency"),
        ("a: k1\na weight=0\n", "keys:2: weight must be a number in (0, 1e+06], got 0.0"),
        ("a: k1\na weight=heavy\n", "keys:2: weight must be a number, got 'heavy'"),
        ("a: k1\na weight=nan\n", "keys:2: weight must be finite"),
        ("a: k1\na max_concurrency=0\n", "keys:2: max_concurrency must be a whole number >= 1, got 0"),
        (
            "a: k1\na tokens_per_minute=1.5\n",
            "keys:2: tokens_per_minute must be a whole number >= 1, got '1.5'",
        ),
        ("a: k1\na weight=1 weight=2\n", "keys:2: weight given twice"),
        ("a: k1\na weight=2\na max_concurrency=3\n", "keys:3: settings for tenant a already given at"),
        ("a: k1\nb/c weight=2\n", "keys:2: tenant 'b/c' must be 1-128 letters"),
    ],
)
def test_a_bad_setting_is_named_with_its_place(tmp_path: Path, text: str, message: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(text)
    with pytest.raises(ValueError) as err:
        load_tenant_settings(keys)
    assert message in str(err.value)


def test_settings_for_a_tenant_without_a_key_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha: k1\nalhpa weight=2\n")
    api_keys, tenants = load_keys((), keys)
    with pytest.raises(ValueError, match="settings for tenant 'alhpa', which no key belongs to"):
        ControlPlaneConfig(
            dataplanes=("h:1",),
            api_keys=api_keys,
            api_key_tenants=tenants,
            tenant_settings=load_tenant_settings(keys),
        )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"*": {"keys": ["k"], "weight": 2}}))
    with pytest.raises(ValueError, match="'\\*' takes settings, not keys"):
        read_keys_file(bad)


# -- through the dispatcher -----------------------------------------------------------------------
def request(rid: str, tenant: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=(1, 2, 3, 4),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        tenant=tenant,
    )


def keyed_config(address: str, **kwargs: object) -> ControlPlaneConfig:
    return ControlPlaneConfig(
        dataplanes=(address,),
        api_keys=("ka", "kb"),
        api_key_tenants=(("ka", "a"), ("kb", "b")),
        tenant_settings=(("a", TenantPolicy(max_concurrency=1, tokens_per_minute=6000)),),
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_slot_and_its_tokens_come_back_on_finish_cancel_and_error() -> None:
    async def test(fake: FakeDataPlane, address: str) -> None:
        dispatcher = Dispatcher(keyed_config(address))
        await dispatcher.start()
        limits = dispatcher.tenants
        try:
            assert await dispatcher.wait_ready(5.0)

            async def run_one(rid: str, end: str, runs: int) -> None:
                events = dispatcher.generate(request(rid, "a"))
                await events.__anext__()  # admitted
                with pytest.raises(ServiceError) as refused:  # a second one of a's: over its limit
                    await dispatcher.generate(request(rid + "-2", "a")).__anext__()
                assert refused.value.code == "RESOURCE_EXHAUSTED" and refused.value.retry_after_s
                assert limits.in_progress["a"] == 1
                assert (await fake.next_command()).submit.request_id == rid
                delta = dataplane_pb2.TokenDelta(request_id=rid, token_ids=[7, 8])
                fake.updates.put_nowait(dataplane_pb2.ConnectResponse(deltas=[delta]))
                streamed = await events.__anext__()
                assert isinstance(streamed, dataplane_pb2.TokenDelta) and list(streamed.token_ids) == [7, 8]
                if end == "finish":
                    done = dataplane_pb2.RequestFinished(request_id=rid)
                    fake.updates.put_nowait(dataplane_pb2.ConnectResponse(finished=[done]))
                    assert isinstance(await events.__anext__(), dataplane_pb2.RequestFinished)
                    with contextlib.suppress(StopAsyncIteration):
                        await events.__anext__()
                elif end == "error":
                    rejected = dataplane_pb2.SubmitRejected(request_id=rid, code="INTERNAL", message="boom")
                    fake.updates.put_nowait(dataplane_pb2.ConnectResponse(rejected=[rejected]))
                    with pytest.raises(ServiceError):
                        await events.__anext__()
                else:  # the client went away
                    await events.aclose()
                    assert (await fake.next_command()).abort.request_id == rid
                assert "a" not in limits.in_progress and dispatcher.admission.held("a") == 0
                # 4 prompt + 8 max charged, 4 + 2 used: 6 given back to the bucket and the counter.
                assert dispatcher.admission.counter("a") == pytest.approx(
                    dispatcher.admission.admitted_tokens["a"] - 6 * runs
                )

            for runs, end in enumerate(("finish", "cancel", "error"), 1):
                await run_one(f"r-{end}", end, runs)
            metrics = ControlPlaneMetrics(dispatcher)
            text = metrics.registry.get_sample_value(
                "pagedserve_tenant_refusals_total", {"tenant": "a", "limit": "max_concurrency"}
            )
            assert text == 3
            admitted = metrics.registry.get_sample_value(
                "pagedserve_tenant_admitted_tokens_total", {"tenant": "a"}
            )
            assert admitted == 3 * 12
            assert (
                metrics.registry.get_sample_value("pagedserve_tenant_requests_queued", {"tenant": "b"}) == 0
            )
        finally:
            await dispatcher.stop()

    with_fake_dataplane(test)


def test_with_two_tenants_a_data_plane_gets_each_tenants_new_requests_while_few_of_its_wait_there() -> None:
    async def test(fake: FakeDataPlane, address: str) -> None:
        config = ControlPlaneConfig(
            dataplanes=(address,),
            api_keys=("ka", "kb"),
            api_key_tenants=(("ka", "a"), ("kb", "b")),
            tenant_settings=(("b", TenantPolicy(weight=3.0)),),
            tenant_dispatch_tokens=64,  # two requests' reservations: 2 blocks of 16 each
        )
        dispatcher = Dispatcher(config)
        await dispatcher.start()
        try:
            assert await dispatcher.wait_ready(5.0)
            streams = {rid: dispatcher.generate(request(rid, rid[0])) for rid in ("a1", "a2", "a3", "b1")}
            firsts = {rid: asyncio.ensure_future(s.__anext__()) for rid, s in streams.items()}
            await wait_for(lambda: len(dispatcher.admission) == 1, "one waits in the control plane")
            # a's two requests waiting there for a first token hold a3 back; b has none there.
            assert dispatcher.admission.waiting() == {"a": 1}
            sent = [(await fake.next_command()).submit for _ in range(3)]
            assert {(c.request_id, c.tenant, c.tenant_weight) for c in sent} == {
                ("a1", "a", 1.0),
                ("a2", "a", 1.0),
                ("b1", "b", 3.0),
            }
            # a1's first token: it left the data plane's queue, so a3 may go down.
            delta = dataplane_pb2.TokenDelta(request_id="a1", token_ids=[5])
            fake.updates.put_nowait(dataplane_pb2.ConnectResponse(deltas=[delta]))
            assert (await fake.next_command()).submit.request_id == "a3"
            assert dispatcher.admission.waiting() == {}
            for rid in ("a1", "a2", "a3", "b1"):  # the clients go away
                firsts[rid].cancel()
                await asyncio.gather(firsts[rid], return_exceptions=True)
                await streams[rid].aclose()
            assert dispatcher.admission.held("a") == 0 and dispatcher.admission.held("b") == 0
        finally:
            await dispatcher.stop()

    with_fake_dataplane(test)


def test_one_tenant_has_no_dispatch_cap() -> None:
    one = Dispatcher(
        ControlPlaneConfig(
            dataplanes=("h:1",), api_keys=("k1", "k2"), api_key_tenants=(("k1", "a"), ("k2", "a"))
        )
    )
    assert one._pending_tokens is None  # all its requests go to the data planes as before
    two = Dispatcher(ControlPlaneConfig(dataplanes=("h:1",), api_keys=("k1", "k2")))
    assert two._pending_tokens == 4096  # two keys without a named tenant: two tenants
    off = Dispatcher(ControlPlaneConfig(dataplanes=("h:1",), api_keys=("k1", "k2"), tenant_dispatch_tokens=0))
    assert off._pending_tokens is None


def test_requests_without_keys_are_the_default_tenant() -> None:
    assert request("r", DEFAULT_TENANT).tenant == "default"
    plain = GenerationRequest(
        request_id="r", prompt_token_ids=(1,), sampling_params=SamplingParams(max_tokens=2)
    )
    assert plain.tenant == DEFAULT_TENANT and plain.max_total_tokens == 3
    dispatcher = Dispatcher(ControlPlaneConfig(dataplanes=("h:1",)))
    assert list(dispatcher.tenants.policies) == [DEFAULT_TENANT]


def test_the_dispatch_cap_holds_to_a_step_of_prefill_and_the_free_batch_slots() -> None:
    def fits(
        pending: int,
        pending_tokens: int,
        running: int,
        limit: int | None = 2048,
        preempts: bool = False,
        share_slots: int = 0,
    ) -> bool:
        return Candidate(
            dataplane="d",
            prompt_blocks=2,
            cached_blocks=0,
            need_blocks=3,
            available_blocks=100,
            total_blocks=100,
            num_running=running,
            num_waiting=0,
            in_flight=running + pending,
            max_num_seqs=16,
            preempts=preempts,
            pending=pending,
            pending_tokens=pending_tokens,
            pending_token_limit=limit,
            share_slots=share_slots,
        ).fits

    assert fits(pending=7, pending_tokens=336, running=8)  # 8 free slots
    assert not fits(pending=8, pending_tokens=384, running=8)  # they would all wait there
    assert fits(pending=3, pending_tokens=144, running=16)  # a full batch keeps MIN_PENDING
    assert not fits(pending=MIN_PENDING, pending_tokens=192, running=16)
    assert not fits(pending=2, pending_tokens=2048, running=0)  # a step of prefill queued
    assert fits(pending=2, pending_tokens=2048, running=0, limit=None)  # one tenant: no cap
    assert fits(pending=9, pending_tokens=4096, running=16, preempts=True)  # a better priority
    # What the tenant's weighted share of the batch leaves it (its in flight counted) may wait
    # there too: the data plane's scheduler preempts a tenant over its share to make room.
    assert fits(pending=6, pending_tokens=288, running=16, share_slots=7)
    assert not fits(pending=7, pending_tokens=336, running=16, share_slots=7)


def test_a_tenants_share_of_a_batch() -> None:
    # 32 seats between the tenants in flight there and the newcomer, by weight, less its own.
    assert share_slots(32, "b", {}, {"a": 40}) == 16
    assert share_slots(32, "b", {}, {"a": 40, "b": 6}) == 10
    assert share_slots(32, "b", {"b": 3.0}, {"a": 40}) == 24
    assert share_slots(32, "b", {}, {"a": 40, "c": 1, "gone": 0}) == 10  # 32 / 3
    assert share_slots(32, "a", {}, {"a": 40}) == -8  # alone, and past the whole batch
