"""Admission that cannot block, against real servers: a request that can never fit (counting
all its samples) is refused at once; a request leaving the queue (deadline, disconnect) wakes
it, so the next one is admitted at once; an HTTP client that disconnects while queued leaves
the queue at once and its request never runs.

The scenarios hold the budget still by holding the data plane's engine loop until released
(an event, part of the scenario, not a wait): a request admitted then keeps its reservation
(20 decode blocks per sample here) until the engine reports again, so what the queue does in
the meantime is decided by the control plane alone. "At once" is told from "at its deadline"
by the outcome (a request that was only woken by its own deadline would be refused), never by
the wall clock; the waits' bounds only guard against a hang.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import Http
from tests.e2e.harness import HeldEngine, ServerThread, engine_config, wait_until

RESERVE = 20  # decode blocks reserved per sample: 1 prompt block + 20 × n of the 64
GUARD_S = 30.0  # a hang guard, well under the calls' own deadlines (60 s)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(tiny, num_blocks=64), tiny, decode_reserve_blocks=RESERVE)
    yield srv
    idle = srv.wait_idle()
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()


def request(n: int = 1, max_tokens: int = 2, **kw: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
        **kw,  # type: ignore[arg-type]
    )


class Call(threading.Thread):
    """One Generate call in the background: its completions or its error."""

    def __init__(self, address: str, req: generation_pb2.GenerateRequest, timeout: float = 60) -> None:
        super().__init__(daemon=True)
        self.address, self.req, self.timeout = address, req, timeout
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            try:
                for r in generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                    self.req, timeout=self.timeout
                ):
                    if r.HasField("complete"):
                        self.tokens.append(r.complete.usage.completion_tokens)
            except grpc.RpcError as exc:
                self.error = exc


def queued(server: ServerThread) -> int:
    return len(server.controlplane.dispatcher.admission)


def submitted(server: ServerThread) -> int:
    return sum(len(c.handles) for c in server.controlplane.dispatcher.connections.values())


def test_n_10000_is_refused_at_once_on_both_protocols(server: ServerThread) -> None:
    with grpc.insecure_channel(server.grpc_address) as ch, pytest.raises(grpc.RpcError) as err:
        list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(request(n=10_000), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "sampling_params.n must be at most 128, got 10000"
    reply = Http(server.http_url).post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "n": 10_000})
    assert reply.status == 400 and reply.json()["error"]["param"] == "n"
    assert queued(server) == 0


def test_a_request_whose_samples_can_never_be_reserved_is_refused_at_once(server: ServerThread) -> None:
    # 4 samples reserve 1 + 4 × 20 = 81 blocks of a 64-block pool: before, this queued (even on
    # an idle pool) until its deadline. Held engine: a refusal that waited for the engine to
    # report, or for the deadline, would not come while it is held.
    with HeldEngine(server.dataplane.loop):
        call = Call(server.grpc_address, request(n=4))
        call.join(GUARD_S)
        reply = Http(server.http_url).post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "n": 4})
    assert reply.status == 400 and reply.json()["error"]["param"] == "n"
    assert call.error is not None
    assert call.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert call.error.details() == (
        "the request's 4 sample(s) reserve 81 KV blocks (1 for the prompt + 20 per sample) "
        "but the whole pool has only 64; lower n"
    )
    ok = Call(server.grpc_address, request(n=3))  # 61 blocks: fits an idle pool
    ok.join(GUARD_S)
    assert ok.error is None and ok.tokens == [2, 2, 2]


def test_a_request_behind_one_that_leaves_the_queue_at_its_deadline_is_admitted_at_once(
    server: ServerThread,
) -> None:
    server.wait_idle()
    held = HeldEngine(server.dataplane.loop)
    running = Call(server.grpc_address, request(n=1))  # reserves 21: 43 of 64 left
    wait_until(lambda: submitted(server) == 1, GUARD_S, "the first request is admitted")
    big = Call(server.grpc_address, request(n=3), timeout=5.0)  # needs 61: waits at the head
    wait_until(lambda: queued(server) == 1, GUARD_S, "the big request queues")
    small = Call(server.grpc_address, request(n=1))  # needs 21: fits, but queues behind (FIFO)
    wait_until(lambda: queued(server) == 2, GUARD_S, "the small request queues behind it")
    # The big one's deadline passes: the small one is admitted at once (before: at its own
    # deadline, 60 s, or when the engine next reported), while the engine is still held.
    wait_until(
        lambda: queued(server) == 0 and submitted(server) == 2, GUARD_S, "the small request is admitted"
    )
    assert held.holding
    held.release()
    big.join(GUARD_S)
    assert big.error is not None and big.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for call in (running, small):
        call.join(GUARD_S)
        assert call.error is None and call.tokens == [2]


@pytest.mark.parametrize("stream", [True, False])
def test_an_http_client_that_disconnects_while_queued_leaves_the_queue_at_once_and_never_runs(
    server: ServerThread, stream: bool
) -> None:
    engine = server.dataplane.loop.engine
    before = engine.kv_cache.prefix_cache_stats.requests  # type: ignore[attr-defined]
    aborted_before = server.wait_idle().snapshot.stats.num_aborted_requests
    held = HeldEngine(server.dataplane.loop)
    running = Call(server.grpc_address, request(n=1))  # reserves 21 of 64
    wait_until(lambda: submitted(server) == 1, GUARD_S, "the first request is admitted")
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"prompt": [8, 9], "max_tokens": 2, "n": 3, "stream": stream}  # needs 61: waits
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    wait_until(lambda: queued(server) == 1, GUARD_S, "the HTTP request queues")
    assert conn.sock is not None
    conn.sock.close()  # the client goes away while its request waits for blocks
    wait_until(lambda: queued(server) == 0, GUARD_S, "the disconnected request leaves the queue")
    assert held.holding and submitted(server) == 1  # it was never admitted
    held.release()
    running.join(GUARD_S)
    assert running.error is None and running.tokens == [2]
    idle = server.wait_idle()
    # Only the first request ever reached the data plane: the other was neither run nor aborted.
    assert engine.kv_cache.prefix_cache_stats.requests == before + 1  # type: ignore[attr-defined]
    assert idle.snapshot.stats.num_aborted_requests == aborted_before
