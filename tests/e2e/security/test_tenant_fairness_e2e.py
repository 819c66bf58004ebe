"""Tenants end to end on a tiny model, over both planes: while tenant a floods the server,
tenant b's requests are served between a's (b's first tokens come while a's flood still
waits, after at most a few more of a's), every request finishes with all its tokens, the pool ends free, and the
per-tenant metrics say what happened; a tenant at its max_concurrency is refused
RESOURCE_EXHAUSTED with a retry-after (gRPC trailer, HTTP 429 header), and its slot comes
back when its stream ends. Orders of events are asserted, never timings, and every wait
is bounded (a test that fails, never one that hangs)."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.clients.python import AsyncGenerationClient, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.server import start_control_plane
from pagedserve.controlplane.tenancy.auth import load_keys, load_tenant_settings
from tests.e2e.harness import engine_config, start_dataplane, wait_idle, wait_until_async

FLOOD = 48
VICTIM = 4
MAX_TOKENS = 12


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(16)]


def http_post(port: int, key: str, body: dict[str, object]) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    reply = conn.getresponse()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read().decode()


def scrape(port: int) -> Callable[[str, dict[str, str]], float | None]:
    """The control plane's /metrics as served: a sample's value by name and labels."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return lambda name, labels: values.get((name, tuple(sorted(labels.items()))))


@pytest.mark.timeout(300)
def test_a_flooding_tenant_does_not_starve_another_and_limits_refuse_with_a_hint(
    tiny: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("a: key-a\nb: key-b\nc: key-c\nc max_concurrency=1\n")
    api_keys, tenants = load_keys((), keys)

    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=256))  # max_num_seqs 16
        config = ControlPlaneConfig(
            model=str(tiny),
            dataplanes=(dp.address,),
            api_keys=api_keys,
            api_key_tenants=tenants,
            tenant_settings=load_tenant_settings(keys),
            tenant_dispatch_tokens=128,  # four requests' reservations (2 blocks of 16)
        )
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=0)
        assert await cp.dispatcher.wait_ready(10.0)
        address = f"127.0.0.1:{cp.grpc_port}"
        firsts: list[str] = []  # "a" / "b", in the order requests got their first token
        try:
            async with (
                AsyncGenerationClient(address, api_key="key-a", retry=NO_RETRY) as a,
                AsyncGenerationClient(address, api_key="key-b", retry=NO_RETRY) as b,
                AsyncGenerationClient(address, api_key="key-c", retry=NO_RETRY) as c,
            ):

                async def one(client: AsyncGenerationClient, tenant: str, seed: int) -> int:
                    tokens = 0
                    stream = client.generate_stream(
                        prompt(seed), max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    )
                    async for item in stream:
                        if isinstance(item, StreamChunk) and item.token_ids:
                            if not tokens:
                                firsts.append(tenant)
                            tokens += len(item.token_ids)
                    return tokens

                flood = [asyncio.create_task(one(a, "a", i)) for i in range(FLOOD)]

                def arrived() -> int:  # a's calls the control plane has picked up, ended ones too
                    ended = sum(task.done() for task in flood)
                    return cp.dispatcher.tenants.in_progress.get("a", 0) + ended

                # All of a's flood has reached the control plane (the calls are picked up one at a
                # time, and on a slow machine the first may end before the last arrives), and a is
                # being served.
                await wait_until_async(lambda: firsts and arrived() >= FLOOD, 60, "a's flood arriving")
                assert cp.dispatcher.admission.waiting().get("a", 0) > 0  # the rest wait in the fair queue
                a_before_b = len(firsts)  # a's requests that had started when b sent
                victims = [asyncio.create_task(one(b, "b", 100 + i)) for i in range(VICTIM)]
                done = await asyncio.wait_for(asyncio.gather(*flood, *victims), 120)
                assert done == [MAX_TOKENS] * (FLOOD + VICTIM)
                b_at = [i for i, tenant in enumerate(firsts) if tenant == "b"]
                a_after_b = firsts[b_at[-1] :].count("a")
                a_between = firsts[a_before_b : b_at[-1]].count("a")
                print(
                    f"\nfirst tokens in order: {''.join(firsts)}; b sent after {a_before_b}; "
                    f"{a_between} of a's started after that and before b's last, {a_after_b} after it"
                )
                # Under a first-come-first-served queue all of a's waiting flood would start before
                # b's last (a_after_b == 0). Fair share lets only a's requests already dispatched (a
                # window of 4) and those picked up while b's calls arrive one at a time go first.
                assert a_after_b >= 1 and a_between <= FLOOD // 4, firsts

                # c may have one request in progress: a second is refused with a hint, on both APIs.
                holding = asyncio.create_task(
                    c.generate(prompt(7), max_tokens=400, temperature=0.0, ignore_eos=True)
                )
                await wait_until_async(lambda: cp.dispatcher.tenants.in_progress.get("c"), 60, "c starting")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await c.generate(prompt(8), max_tokens=2)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "tenant c has 1 requests in progress" in (refused.value.details() or "")
                trailers = dict(refused.value.trailing_metadata() or ())
                assert float(trailers["retry-after"]) >= 1
                assert cp.http_port is not None
                status, headers, body = await asyncio.to_thread(
                    http_post, cp.http_port, "key-c", {"prompt": [5, 6, 7], "max_tokens": 2}
                )
                assert status == 429 and int(headers["retry-after"]) >= 1, body
                assert "max_concurrency 1" in json.loads(body)["error"]["message"]
                await holding
                assert (await c.generate(prompt(9), max_tokens=2))[0].token_ids  # its slot came back

            sample = await asyncio.to_thread(scrape, cp.http_port)
            assert (
                sample("pagedserve_tenant_refusals_total", {"tenant": "c", "limit": "max_concurrency"}) == 2
            )
            assert sample("pagedserve_tenant_admitted_tokens_total", {"tenant": "b"}) == VICTIM * (
                16 + MAX_TOKENS
            )
            assert sample("pagedserve_tenant_requests_queued", {"tenant": "a"}) == 0
            assert sample("pagedserve_tenant_requests_in_progress", {"tenant": "c"}) == 0
            after = (await wait_idle(dp.address)).snapshot.stats
            assert after.free_blocks == after.total_blocks
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())
