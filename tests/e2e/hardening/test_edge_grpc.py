"""The gRPC edge against real servers: issue 12's cases over GenerationService. A huge `n` is
a cheap INVALID_ARGUMENT (no per-sample state is built), an undecodable payload is
INVALID_ARGUMENT (not UNKNOWN), client request ids are labels only (any characters, reused
by two requests at once), long names are refused without being echoed, and max_tokens beyond
the context is refused as over HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.controlplane.edge.servicer import GenerationServicer, add_generation_service
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

CONTEXT = 256
SERVICE = "/pagedserve.v1.GenerationService"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(model, num_blocks=64, max_model_len=CONTEXT), model)
    yield srv
    idle = srv.wait_idle()
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_address) as ch:
        yield ch


def generate(
    channel: grpc.Channel, timeout: float = 60, **kw: object
) -> list[generation_pb2.GenerateResponse]:
    params = kw.pop("params", None) or common_pb2.SamplingParams(max_tokens=2)
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=params,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    return list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=timeout))


def refused(channel: grpc.Channel, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        generate(channel, **kw)
    return err.value


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_grpc_n_4294967295_is_a_cheap_invalid_argument(channel: grpc.Channel) -> None:
    # Before: one detokenizer per sample was built before admission (14.9 GB, then OOM-killed).
    before, started = rss_bytes(), time.monotonic()
    err = refused(channel, params=common_pb2.SamplingParams(max_tokens=2, n=2**32 - 1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "sampling_params.n must be at most 128, got 4294967295"
    assert time.monotonic() - started < 2.0
    assert rss_bytes() - before < 64 << 20


@pytest.mark.parametrize(
    ("params", "details"),
    [
        (
            common_pb2.SamplingParams(max_tokens=2**32 - 1),
            f"sampling_params.max_tokens is too large: {2**32 - 1}. This model's maximum context length "
            f"is {CONTEXT} tokens and your request has 3 input tokens ({2**32 - 1} > {CONTEXT} - 3)",
        ),
        (common_pb2.SamplingParams(max_tokens=2, top_k=-5), "sampling_params.top_k must be -1, 0"),
        (common_pb2.SamplingParams(max_tokens=2, seed=-1), "sampling_params.seed must be a non-negative"),
        (
            common_pb2.SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}),
            "sampling_params.logit_bias keys must be token ids in [0, 384), got [1000000]",
        ),
    ],
)
def test_grpc_out_of_range_fields_are_invalid_argument_naming_them(
    channel: grpc.Channel, params: common_pb2.SamplingParams, details: str
) -> None:
    err = refused(channel, params=params)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith(details), err.details()


def test_grpc_top_p_1e_minus_9_is_accepted(channel: grpc.Channel) -> None:
    out = generate(channel, params=common_pb2.SamplingParams(max_tokens=3, top_p=1e-9, ignore_eos=True))
    assert [r.complete.usage.completion_tokens for r in out if r.HasField("complete")] == [3]


def test_grpc_10k_character_model_name_is_refused_without_being_echoed(channel: grpc.Channel) -> None:
    err = refused(channel, model="m" * 10_000)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "model: at most 256 characters"
    with pytest.raises(grpc.RpcError) as tok:
        generation_pb2_grpc.GenerationServiceStub(channel).Tokenize(
            generation_pb2.TokenizeRequest(model="m" * 10_000, text="hi"), timeout=10
        )
    assert tok.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("request_id", ["a#b", "x/y", "#", "id with spaces\t", "ünïcode-☃"])
def test_a_request_id_with_any_character_gets_its_tokens_and_is_echoed(
    channel: grpc.Channel, request_id: str
) -> None:
    out = generate(
        channel, request_id=request_id, params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert {r.request_id for r in out} == {request_id}
    assert [r.complete.usage.completion_tokens for r in out if r.HasField("complete")] == [3]


def test_reusing_an_in_flight_request_id_does_not_touch_the_original(
    channel: grpc.Channel, server: ServerThread
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    long = generation_pb2.GenerateRequest(
        request_id="dup",
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=common_pb2.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    stream = stub.Generate(long, timeout=60)
    first = next(stream)  # the original is running ...
    assert first.request_id == "dup"
    # ... when another request arrives with the same id: it runs on its own,
    short = generate(
        channel, request_id="dup", params=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert [r.complete.usage.completion_tokens for r in short if r.HasField("complete")] == [2]
    # and the original is neither stalled nor cut short.
    rest = list(stream)
    done = [r.complete for r in rest if r.HasField("complete")]
    assert [d.usage.completion_tokens for d in done] == [200]
    assert done[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert {r.request_id for r in rest} == {"dup"}


def test_concurrent_requests_reusing_one_id_all_finish(channel: grpc.Channel) -> None:
    results: list[int] = []

    def one() -> None:
        out = generate(
            channel, request_id="same", params=common_pb2.SamplingParams(max_tokens=5, ignore_eos=True)
        )
        results.extend(r.complete.usage.completion_tokens for r in out if r.HasField("complete"))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [5] * 6


# -- undecodable payloads --------------------------------------------------------------------------

GARBAGE = [
    b"\xff\xff\xff\xff",  # a truncated varint tag
    b"\x12\x02\xff\xfe",  # field 2 (text) holding invalid UTF-8
]


def _undecodable_is_invalid_argument(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        for payload in GARBAGE:
            tokenize = ch.unary_unary(f"{SERVICE}/Tokenize")
            with pytest.raises(grpc.RpcError) as err:
                tokenize(payload, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "the request is not a valid pagedserve.v1.TokenizeRequest message"
            generate = ch.unary_stream(f"{SERVICE}/Generate")
            with pytest.raises(grpc.RpcError) as err:
                list(generate(payload, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A well-formed payload still works through the same handlers.
        ok = ch.unary_unary(f"{SERVICE}/Tokenize")(
            generation_pb2.TokenizeRequest(text="Say hello.").SerializeToString(), timeout=10
        )
        assert list(generation_pb2.TokenizeResponse.FromString(ok).token_ids)


def test_undecodable_grpc_payloads_are_invalid_argument(server: ServerThread, model: Path) -> None:
    """`add_generation_service` (the registration the control plane should use)."""

    async def start() -> tuple[grpc.aio.Server, int]:
        frontend = Frontend(server.controlplane.dispatcher, Tokenizer(model), str(model))
        srv = grpc.aio.server()
        add_generation_service(GenerationServicer(frontend), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        return srv, port

    srv, port = server._run(start())
    try:
        _undecodable_is_invalid_argument(f"127.0.0.1:{port}")
    finally:
        server._run(srv.stop(0))


def test_undecodable_grpc_payloads_are_invalid_argument_on_the_served_port(server: ServerThread) -> None:
    _undecodable_is_invalid_argument(server.grpc_address)
