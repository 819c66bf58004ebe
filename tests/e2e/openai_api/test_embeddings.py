"""Embeddings end to end against `pagedserve serve` (tiny random model with a tokenizer, prefix
caching on, prompts longer than a prefill chunk): the official `openai` client's
`embeddings.create` (float and base64, every input form), the gRPC `Embed` RPC and the Python
client's `embed`, and every bad
value refused naming its field. The vectors equal transformers' final hidden states (after
the final norm) pooled the same way, fp32; every KV block comes back."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from pagedserve.benchmarks.tiny_models import load_reference_model
from pagedserve.clients.python import AsyncGenerationClient, GenerationClient, build_embed_request
from pagedserve.controlplane.openai.embeddings import encoded
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import Process

TEXTS = ["Hello world, the capital of France is Paris.", "Paged attention keeps the KV cache in blocks."]
MAX_MODEL_LEN = 64
API_KEY = "sk-embed-test"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[tuple[str, str]]:
    """(gRPC address, HTTP URL) of `pagedserve serve` with an API key; prefill chunks of 8 tokens."""
    argv = ["serve", "--model", str(model), "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
    argv += ["--num-gpu-blocks-override", "64", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "4"]
    argv += ["--max-num-batched-tokens", "8", "--api-key", API_KEY]
    proc = Process(argv, "gRPC on ")
    yield proc.address, proc.line.split("HTTP on ", 1)[1].split()[0]
    proc.kill(15)


@pytest.fixture(scope="module")
def client(served: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model: Path) -> Any:
    ref = load_reference_model(model)

    @torch.inference_mode()
    def pooled(ids: list[int], pooling: str = "last", normalize: bool = True) -> list[float]:
        hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()

    return pooled


def assert_close(ours: list[float], expected: list[float]) -> None:
    assert len(ours) == len(expected)
    assert torch.allclose(torch.tensor(ours), torch.tensor(expected), atol=1e-5, rtol=0)


def test_openai_client_floats_equal_transformers(client: openai.OpenAI, model: Path, reference: Any) -> None:
    tok = Tokenizer(model)
    ids = [tok.encode(t) for t in TEXTS]
    assert max(len(i) for i in ids) > 8  # longer than a prefill chunk
    first = client.embeddings.create(model="llama", input=TEXTS)
    assert first.object == "list" and first.model == "llama"
    assert [d.index for d in first.data] == [0, 1] and all(d.object == "embedding" for d in first.data)
    assert first.usage.prompt_tokens == first.usage.total_tokens == sum(len(i) for i in ids)
    for d, prompt in zip(first.data, ids, strict=True):
        assert_close(d.embedding, reference(prompt))
        assert abs(sum(x * x for x in d.embedding) - 1.0) < 1e-5
    # Again (the prompts' blocks now cached), one at a time, and as token ids: the same vectors.
    again = client.embeddings.create(model="llama", input=TEXTS[1])
    assert_close(again.data[0].embedding, first.data[1].embedding)
    as_ids = client.embeddings.create(model="llama", input=ids)
    for a, b in zip(as_ids.data, first.data, strict=True):
        assert_close(a.embedding, b.embedding)
    single = client.embeddings.create(model="llama", input=ids[0])
    assert_close(single.data[0].embedding, first.data[0].embedding)


def test_openai_client_base64_decodes_to_the_floats(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="llama", input=TEXTS, encoding_format="float")
    # Asked for explicitly, the client hands the base64 text back as it came: little-endian fp32.
    # (Two calls may batch their inputs differently: equal to fp32 rounding, not bit for bit.)
    encoded_answer = client.embeddings.create(model="llama", input=TEXTS, encoding_format="base64")
    for a, b in zip(encoded_answer.data, floats.data, strict=True):
        assert isinstance(a.embedding, str)
        raw = base64.b64decode(a.embedding)
        assert_close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), b.embedding)
    # Left unset, the client asks for base64 itself and decodes it.
    default = client.embeddings.create(model="llama", input=TEXTS)
    for a, b in zip(default.data, floats.data, strict=True):
        assert_close(a.embedding, b.embedding)
    # The encoding itself is exact: the fp32 values, bit for bit.
    values = floats.data[0].embedding
    raw = base64.b64decode(encoded(values, "base64"))  # type: ignore[arg-type]
    assert list(struct.unpack(f"<{len(values)}f", raw)) == values


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", True), ("last", False)])
def test_pooling_extras(
    client: openai.OpenAI, model: Path, reference: Any, pooling: str, normalize: bool
) -> None:
    ids = Tokenizer(model).encode(TEXTS[0])
    for _ in range(2):  # the second finds the prompt's blocks cached: mean and cls compute every row anyway
        out = client.embeddings.create(
            model="llama", input=TEXTS[0], extra_body={"pooling_type": pooling, "normalize": normalize}
        )
        assert_close(out.data[0].embedding, reference(ids, pooling, normalize))


def test_grpc_embed_equals_http(
    served: tuple[str, str], client: openai.OpenAI, model: Path, reference: Any
) -> None:
    ids = Tokenizer(model).encode(TEXTS[0])
    request = generation_pb2.EmbedRequest(
        request_id="emb-1",
        inputs=[
            generation_pb2.EmbedInput(text=TEXTS[0]),
            generation_pb2.EmbedInput(token_ids=generation_pb2.TokenIds(ids=ids)),
        ],
        pooling=common_pb2.PoolingParams(pooling_type=common_pb2.PoolingParams.POOLING_TYPE_MEAN),
    )
    with grpc.insecure_channel(served[0]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        out = stub.Embed(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(request, timeout=60)  # no key
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert out.request_id == "emb-1" and [e.index for e in out.embeddings] == [0, 1]
    assert out.usage.prompt_tokens == 2 * len(ids) and out.usage.completion_tokens == 0
    for e in out.embeddings:
        assert e.prompt_tokens == len(ids)
        assert_close(list(e.values), reference(ids, "mean"))


def test_context_bound(client: openai.OpenAI, reference: Any) -> None:
    full = list(range(3, 3 + MAX_MODEL_LEN))  # a pooling request may fill the context
    assert_close(client.embeddings.create(model="llama", input=full).data[0].embedding, reference(full))
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="llama", input=[*full, 5])
    assert "max_model_len is 64" in str(refused.value) and refused.value.body["param"] == "input"  # type: ignore[index]


def post(url: str, body: object, key: str | None = API_KEY) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}/v1/embeddings",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [1, 2, 10**6]}, "input"),
        ({"input": [[1, 2], [-1]]}, "input[1]"),
        ({"input": ["x"] * 257}, "input"),
        ({"input": "hi", "model": "other"}, "model"),
        ({"input": "hi", "pooling_type": "max"}, "pooling_type"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "priority": 10**9}, "priority"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "normalize": "yes"}, "normalize"),
        ({"input": {"text": "hi"}}, "input"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    served: tuple[str, str], body: dict[str, Any], param: str
) -> None:
    status, answer = post(served[1], body)
    assert 400 <= status < 500, (status, answer)
    assert param in (answer["error"].get("param") or "") or param in answer["error"]["message"], answer


def test_grpc_bad_input_is_invalid_argument(served: tuple[str, str]) -> None:
    cases = {
        "inputs": generation_pb2.EmbedRequest(),
        "inputs[0]": generation_pb2.EmbedRequest(inputs=[generation_pb2.EmbedInput()]),
        "inputs[1].token_ids": generation_pb2.EmbedRequest(
            inputs=[
                generation_pb2.EmbedInput(text="ok"),
                generation_pb2.EmbedInput(token_ids=generation_pb2.TokenIds(ids=[10**6])),
            ]
        ),
        "inputs[0].text": generation_pb2.EmbedRequest(inputs=[generation_pb2.EmbedInput(text="")]),
        "pooling.pooling_type": generation_pb2.EmbedRequest(
            inputs=[generation_pb2.EmbedInput(text="ok")],
            pooling=common_pb2.PoolingParams(pooling_type=common_pb2.PoolingParams.PoolingType.ValueType(9)),
        ),
    }
    cases["inputs "] = generation_pb2.EmbedRequest(inputs=[generation_pb2.EmbedInput(text="x")] * 257)
    with grpc.insecure_channel(served[0]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for name, request in cases.items():
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert name.strip() in (refused.value.details() or ""), (name, refused.value.details())
    # The server goes on, every block back.
    status, _ = post(served[1], {"input": "still here"})
    assert status == 200


def test_metrics_count_embeddings(served: tuple[str, str]) -> None:
    with urllib.request.urlopen(f"{served[1]}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("pagedserve_embedding_")
    }
    assert counts["pagedserve_embedding_requests_total"] > 0
    assert counts["pagedserve_embedding_inputs_total"] >= counts["pagedserve_embedding_requests_total"]
    assert counts["pagedserve_embedding_prompt_tokens_total"] > counts["pagedserve_embedding_inputs_total"]


def test_python_client_embed(served: tuple[str, str], client: openai.OpenAI, model: Path) -> None:
    ids = Tokenizer(model).encode(TEXTS[1])
    http = client.embeddings.create(model="llama", input=TEXTS, extra_body={"pooling_type": "mean"})
    with GenerationClient(served[0], api_key=API_KEY, timeout=60) as grpc_client:
        vectors = grpc_client.embed(TEXTS, pooling="mean")
        (alone,) = grpc_client.embed(ids, pooling="mean")  # one token-id input
        assert_close(alone, vectors[1])

    async def run() -> list[list[float]]:
        async with AsyncGenerationClient(served[0], api_key=API_KEY, timeout=60) as aio:
            return await aio.embed(TEXTS[0], pooling="mean", normalize=True)

    (first,) = asyncio.run(run())
    assert_close(first, vectors[0])
    for ours, theirs in zip(vectors, http.data, strict=True):
        assert_close(ours, theirs.embedding)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        build_embed_request("x", pooling="max")
