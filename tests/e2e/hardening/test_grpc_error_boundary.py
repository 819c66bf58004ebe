"""The gRPC API's one error boundary (controlplane/src/pagedserve/controlplane/edge/servicer.py): an unexpected exception in
any handler is INTERNAL naming the request id, with one structured log line carrying the id
and the traceback; the server keeps serving; a ServiceError keeps its own status."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.controlplane.edge.servicer import GenerationServicer, add_generation_service
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(model, num_blocks=32, max_model_len=128), model)
    yield srv
    srv.close()


class Broken(Exception):
    """What a bug raises."""


def boom(*args: Any, **kwargs: Any) -> Any:
    raise Broken("a bug in the handler")


@pytest.fixture
def broken(
    server: ServerThread, model: Path
) -> Iterator[tuple[generation_pb2_grpc.GenerationServiceStub, Frontend]]:
    """A second GenerationService over the same data plane whose frontend fails unexpectedly."""
    frontend = Frontend(server.controlplane.dispatcher, Tokenizer(model), str(model))

    async def start() -> tuple[grpc.aio.Server, int]:
        srv = grpc.aio.server()
        add_generation_service(GenerationServicer(frontend), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        return srv, port

    srv, port = server._run(start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield generation_pb2_grpc.GenerationServiceStub(channel), frontend
    finally:
        channel.close()
        server._run(srv.stop(0))


def _internal_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if '"grpc_internal_error"' in line:
            lines.append(json.loads(line))
    return lines


def test_every_rpc_turns_a_bug_into_internal_with_the_request_id(
    broken: tuple[generation_pb2_grpc.GenerationServiceStub, Frontend],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    stub, frontend = broken
    monkeypatch.setattr(frontend, "check_model", boom)
    monkeypatch.setattr(frontend, "model_cards", boom)
    calls = {
        "Generate": lambda: list(
            stub.Generate(
                generation_pb2.GenerateRequest(
                    request_id="client-7", text="hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
                ),
                timeout=30,
            )
        ),
        "Tokenize": lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), timeout=30),
        "Detokenize": lambda: stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[1]), timeout=30),
        "ListModels": lambda: stub.ListModels(generation_pb2.ListModelsRequest(), timeout=30),
    }
    capfd.readouterr()
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INTERNAL, method
        details = err.value.details()
        assert details.startswith("internal server error (request id "), details
        lines = _internal_lines(capfd.readouterr().err)
        assert len(lines) == 1, (method, lines)
        (line,) = lines
        assert line["method"] == method and line["request_id"] in details
        assert "Broken: a bug in the handler" in line["exception"]
        if method == "Generate":
            assert line["request_id"] == "client-7"  # the client's own id, when it sent one
    failures = frontend.metrics.request_failure.labels(code="INTERNAL")._value.get()
    assert failures == 4


def test_a_service_error_keeps_its_status_and_the_server_keeps_serving(
    broken: tuple[generation_pb2_grpc.GenerationServiceStub, Frontend], monkeypatch: pytest.MonkeyPatch
) -> None:
    stub, frontend = broken

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ServiceError("NOT_FOUND", "model: 'x' is not served here", param="model")

    with monkeypatch.context() as patch:
        patch.setattr(frontend, "check_model", refuse)
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    out = list(
        stub.Generate(
            generation_pb2.GenerateRequest(
                text="hi", sampling_params=common_pb2.SamplingParams(max_tokens=2)
            ),
            timeout=60,
        )
    )
    assert out[-1].complete.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


def test_a_request_that_faults_in_a_step_fails_alone_with_internal(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the planes: the poisoned request's client gets INTERNAL naming the request's id,
    the concurrent ones their unpoisoned greedy tokens, every block comes back, the data plane
    counts the fault and keeps serving."""
    from concurrent.futures import ThreadPoolExecutor

    import pagedserve.dataplane.runner.model_runner as model_runner
    from pagedserve.dataplane.runner import sampler

    def ask(channel: grpc.Channel, rid: str, ids: list[int], seed: int | None = None) -> list[int]:
        params = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        if seed is not None:
            params.seed = seed
        request = generation_pb2.GenerateRequest(
            request_id=rid, token_ids=generation_pb2.TokenIds(ids=ids), sampling_params=params
        )
        out = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
        return [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids]

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    with grpc.insecure_channel(server.grpc_address) as channel:
        clean = [ask(channel, f"clean-{i}", p) for i, p in enumerate(prompts)]
        real = sampler.sample

        def sample(logits: Any, params: list[Any], *args: Any) -> Any:
            if any(p.seed == 4242 for p in params):
                raise ValueError("a sampler bug this request alone meets")
            return real(logits, params, *args)

        monkeypatch.setattr(model_runner, "sample", sample)
        with ThreadPoolExecutor(4) as pool:
            poisoned = pool.submit(ask, channel, "poisoned-1", [20, 21, 22], 4242)
            others = [pool.submit(ask, channel, f"other-{i}", p) for i, p in enumerate(prompts)]
            assert [f.result() for f in others] == clean
            with pytest.raises(grpc.RpcError) as err:
                poisoned.result()
        assert err.value.code() == grpc.StatusCode.INTERNAL
        details = err.value.details()
        # the server's id of the request (its logs pair it with the client's "poisoned-1")
        assert re.match(r"internal error while generating request '[0-9a-f]{32}' \(it alone failed", details)
        idle = server.wait_idle()
        assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
        assert server.dataplane.loop.metrics.request_faults._value.get() >= 1
        assert server.dataplane.loop.alive
        assert ask(channel, "after", prompts[0]) == clean[0]
