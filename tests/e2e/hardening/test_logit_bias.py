"""logit_bias, which OpenAI clients send and we used to ignore: the sampler adds it to the
logits before sampling (greedy rows too), and both protocols carry it, validated at the edge
(ids within the vocabulary, biases in [-100, 100], at most 300 entries)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from pagedserve.benchmarks.tiny_models import VOCAB
from pagedserve.common.protocol import sampling_params_from_proto, sampling_params_to_proto
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.runner.sampler import sample
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import Http, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 1.0, 4.9, 0.0, 0.0]])


def test_the_sampler_adds_the_bias_before_greedy_and_sampled_picks() -> None:
    greedy = [SamplingParams(temperature=0.0, logit_bias=((4, 10.0),)), SamplingParams(temperature=0.0)]
    assert [t.token_id for t in sample(LOGITS, greedy, [None, None])] == [4, 0]
    banned = [SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))]
    assert sample(LOGITS[:1], banned, [None])[0].token_id == 3
    forced = SamplingParams(temperature=1.0, seed=1, logit_bias=((2, 100.0),))
    for seed in range(20):
        g = torch.Generator()
        g.manual_seed(seed)
        assert sample(LOGITS[:1], [forced], [g])[0].token_id == 2
    # Logprobs stay those of the model's own distribution; ids past the vocabulary are ignored.
    out = sample(
        LOGITS[:1], [SamplingParams(temperature=0.0, logprobs=0, logit_bias=((4, 10.0), (99, 5.0)))], [None]
    )
    assert out[0].token_id == 4
    assert out[0].logprob == pytest.approx(float(LOGITS[0].log_softmax(-1)[4]))
    assert LOGITS[0, 4] == -1.0  # the caller's tensor is untouched


def test_logit_bias_travels_the_wire_unchanged() -> None:
    params = SamplingParams(max_tokens=3, logit_bias=((7, 100.0), (3, -0.5)))
    assert params.logit_bias == ((3, -0.5), (7, 100.0))
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(tiny, num_blocks=64), tiny)
    yield srv
    srv.wait_idle()
    srv.close()


def test_logit_bias_over_http(server: ServerThread) -> None:
    http = Http(server.http_url)
    token = http.post("/tokenize", {"prompt": " the"}).json()["tokens"][0]
    body = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    forced = http.post("/v1/completions", {**body, "logit_bias": {str(token): 100}}).json()
    assert forced["usage"]["completion_tokens"] == 6
    assert forced["choices"][0]["text"] == http.post("/detokenize", {"tokens": [token] * 6}).json()["prompt"]
    chat = http.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {str(token): 100}},
    ).json()
    assert chat["choices"][0]["message"]["content"] == " the" * 3
    for bad, message in [
        ({str(VOCAB): 1}, f"logit_bias keys must be token ids in [0, {VOCAB}), got [{VOCAB}]"),
        ({"5": 101}, "logit_bias values must be in [-100, 100], got 101.0"),
        ({"5": -100.5}, "logit_bias values must be in [-100, 100], got -100.5"),
        ({str(i): 1 for i in range(301)}, "logit_bias must have at most 300 entries, got 301"),
        ({"abc": 1}, "logit_bias keys must be token ids, got 'abc'"),
    ]:
        reply = http.post("/v1/completions", {**body, "logit_bias": bad})
        assert reply.status == 400, reply.text
        assert reply.json()["error"]["message"] == message
        assert reply.json()["error"]["param"] == "logit_bias"


def test_logit_bias_over_grpc(server: ServerThread) -> None:
    params = common_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={42: 100.0})
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]), sampling_params=params, request_id="bias"
    )
    with grpc.insecure_channel(server.grpc_address) as ch:
        out = list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(request, timeout=30))
        ids = [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids]
        assert ids == [42] * 6
        request.sampling_params.logit_bias[3] = -250.0
        with pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "sampling_params.logit_bias values must be in [-100, 100], got -250.0"


def test_logit_bias_from_the_python_client(server: ServerThread) -> None:
    from pagedserve.clients.python import GenerationClient

    with GenerationClient(server.grpc_address, timeout=30) as client:
        out = client.generate(
            [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0}
        )
    assert out[0].token_ids == [42] * 4
