"""HTTP status codes of the OpenAI API under load and failure (tiny model, token-id prompts):
429 with Retry-After when the admission queue is full, a non-streaming client that hangs up
aborts its request, and 503 when no data plane is available (last: it drains the data plane)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from tests.e2e.harness import ServerThread, engine_config, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    # Every request reserves 61 of the 64 blocks: one runs, one may wait, the next is refused.
    srv = ServerThread(engine_config(tiny, num_blocks=64), tiny, max_queue_len=1, decode_reserve_blocks=60)
    yield srv
    srv.close()


def test_queue_full_is_429_with_retry_after(server: ServerThread) -> None:
    model = server.controlplane.dispatcher.config.model
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0, timeout=60)
    long_stream = client.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for seen, _ in enumerate(long_stream, start=1):
        if seen == 120:  # 8 blocks in use: 56 free < 61 needed by the next request
            break
    waiting = threading.Thread(
        target=lambda: client.completions.create(model=model, prompt=[8, 9], max_tokens=2)
    )
    waiting.start()
    wait_until(lambda: len(server.controlplane.dispatcher.admission) >= 1, 30, "the second request queues")
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt=[10, 11], max_tokens=2)
    assert err.value.status_code == 429
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert "queue is full" in str(err.value.body)
    long_stream.close()  # frees the blocks: the waiting request runs
    waiting.join(30)
    assert not waiting.is_alive()
    server.wait_idle()


def test_non_streaming_client_disconnect_aborts_the_request(server: ServerThread) -> None:
    import http.client
    import json

    aborted_before = server.wait_idle().snapshot.stats.num_aborted_requests
    model = server.controlplane.dispatcher.config.model
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
    )
    wait_until(lambda: server.state().requests, what="the request runs on the data plane")
    assert conn.sock is not None
    conn.sock.close()  # the client gives up before the (non-streamed) answer
    idle = server.wait_idle(timeout_s=10)
    assert idle.snapshot.stats.num_aborted_requests == aborted_before + 1


def test_no_data_plane_is_503(server: ServerThread) -> None:
    from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

    async def drain() -> None:
        import grpc

        async with grpc.aio.insecure_channel(server.dataplane.address) as channel:
            await dataplane_pb2_grpc.DataPlaneServiceStub(channel).Drain(
                dataplane_pb2.DrainRequest(), timeout=5
            )

    server._run(drain())
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0, timeout=30)
    model = server.controlplane.dispatcher.config.model
    wait_until(lambda: not server.controlplane.dispatcher.healthy, what="the control plane sees the drain")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model, prompt=[5, 6], max_tokens=2)
    assert err.value.status_code == 503
    assert "no data plane" in str(err.value.body)
