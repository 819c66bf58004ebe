"""Prompt logprobs and echo end to end (tiny random model with a tokenizer, prefix caching on):
the official `openai` client's `completions.create(echo=True, logprobs=1, max_tokens=0)` (what
lm-eval's loglikelihood requests send), vLLM's `prompt_logprobs` on completions and chat, the
gRPC field, and every bad value refused naming its field. The logprobs equal transformers'
fp32 log_softmax at each next prompt token."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from pagedserve.benchmarks.tiny_models import load_reference_model
from pagedserve.clients.python import GenerationClient, StreamChunk
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

PROMPT = "Hello world, the capital of France is Paris."


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(model, num_blocks=128, max_model_len=512, block_size=4), model)
    yield srv
    idle = srv.wait_idle()
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(model: Path) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log_softmax at each of its positions [P, vocab]."""
    ids = Tokenizer(model).encode(PROMPT)
    with torch.inference_mode():
        logits = load_reference_model(model)(torch.tensor([ids])).logits[0].float()
    return ids, logits.log_softmax(dim=-1)


def reference_logprobs(ids: list[int], logprobs: torch.Tensor) -> list[float]:
    return [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]


def test_echo_prompt_only_equals_transformers(
    client: openai.OpenAI, server: ServerThread, expected: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = expected
    ref = reference_logprobs(ids, logprobs)
    for _ in range(2):  # the second finds the first's blocks cached, and still scores every token
        out = client.completions.create(model="llama", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
        choice = out.choices[0]
        assert choice.text == PROMPT
        assert choice.finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 0
        lps = choice.logprobs
        assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
        assert len(lps.token_logprobs) == len(ids)
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        assert lps.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
        tok = Tokenizer(server.controlplane.dispatcher.config.model)
        assert lps.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        for p, top in enumerate(lps.top_logprobs[1:], start=1):
            best = int(logprobs[p - 1].argmax())
            assert top is not None
            assert top[tok.decode([best], skip_special_tokens=False)] == pytest.approx(
                float(logprobs[p - 1, best]), abs=1e-4
            )
    server.wait_idle()


def test_echo_with_a_generated_token_and_token_id_prompts(
    client: openai.OpenAI, expected: tuple[list[int], torch.Tensor]
) -> None:
    # lm-eval's local-completions request: token ids, echo, logprobs 1, max_tokens 1.
    ids, logprobs = expected
    out = client.completions.create(
        model="llama", prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    first, second = out.choices
    assert first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert len(first.logprobs.token_logprobs) == len(ids) + 1
    assert first.logprobs.token_logprobs[1:-1] == pytest.approx(reference_logprobs(ids, logprobs), abs=1e-4)
    greedy = int(logprobs[-1].argmax())
    assert first.logprobs.token_logprobs[-1] == pytest.approx(float(logprobs[-1, greedy]), abs=1e-4)
    assert second.logprobs is not None and second.logprobs.token_logprobs is not None
    assert second.logprobs.token_logprobs[1:5] == pytest.approx(
        reference_logprobs(ids[:5], logprobs), abs=1e-4
    )
    offsets = first.logprobs.text_offset
    assert offsets is not None and offsets[0] == 0 and offsets == sorted(offsets)


def check_vllm_shape(entries: list[Any], ids: list[int], logprobs: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[p].items()}
        row = logprobs[p - 1]
        assert entry[ids[p]]["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert entry[ids[p]]["rank"] == int((row > row[ids[p]]).sum()) + 1
        values, top = row.topk(k)
        for rank, (t, v) in enumerate(zip(top.tolist(), values.tolist(), strict=True), start=1):
            assert entry[t]["logprob"] == pytest.approx(v, abs=1e-4)
            assert entry[t]["rank"] == rank
            assert isinstance(entry[t]["decoded_token"], str)


def test_vllm_prompt_logprobs_on_completions_and_chat(
    client: openai.OpenAI, model: Path, expected: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = expected
    out = client.completions.create(
        model="llama", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    check_vllm_shape(out.choices[0].model_extra["prompt_logprobs"], ids, logprobs, 2)  # type: ignore[index]

    messages = [{"role": "user", "content": "Say something nice."}]
    chat = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    tok = Tokenizer(model)
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    with torch.inference_mode():
        logits = load_reference_model(model)(torch.tensor([chat_ids])).logits[0].float()
    check_vllm_shape(chat.model_extra["prompt_logprobs"], chat_ids, logits.log_softmax(dim=-1), 1)  # type: ignore[index]


def post(server: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/completions", {"echo": "yes", "max_tokens": 1}, "echo"),
        ("/v1/completions", {"echo": 1, "max_tokens": 1}, "echo"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"echo": False, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": True}, "prompt_logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": "many"}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    server: ServerThread, path: str, extra: dict[str, Any], field: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 2, **extra}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == field, answer


def test_grpc_prompt_logprobs(server: ServerThread, expected: tuple[list[int], torch.Tensor]) -> None:
    ids, logprobs = expected
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=ids),
            sampling_params=common_pb2.SamplingParams(max_tokens=2, prompt_logprobs=3),
        )
        chunks = [r.chunk for r in stub.Generate(request, timeout=60) if r.HasField("chunk")]
        assert len(chunks[0].prompt_logprobs) == len(ids) - 1
        assert all(not c.prompt_logprobs for c in chunks[1:])
        got = [e.logprob for e in chunks[0].prompt_logprobs]
        assert got == pytest.approx(reference_logprobs(ids, logprobs), abs=1e-4)
        assert all(len(e.top) == 3 for e in chunks[0].prompt_logprobs)

        bad = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=ids),
            sampling_params=common_pb2.SamplingParams(max_tokens=2, prompt_logprobs=21),
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.prompt_logprobs" in err.value.details()


def test_python_client_prompt_logprobs(
    server: ServerThread, expected: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = expected
    with GenerationClient(server.grpc_address, timeout=60) as client:
        items = list(client.generate_stream(ids, max_tokens=2, prompt_logprobs=0))
    chunks = [i for i in items if isinstance(i, StreamChunk)]
    got = [e.logprob for e in chunks[0].prompt_logprobs]
    assert got == pytest.approx(reference_logprobs(ids, logprobs), abs=1e-4)
    assert all(not c.prompt_logprobs for c in chunks[1:])


def test_streams_carry_prompt_logprobs_on_their_first_chunk(
    client: openai.OpenAI, model: Path, expected: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = expected
    chunks = list(
        client.completions.create(
            model="llama", prompt=PROMPT, max_tokens=3, stream=True, extra_body={"prompt_logprobs": 1}
        )
    )
    carrying = [c for c in chunks if c.choices and "prompt_logprobs" in (c.choices[0].model_extra or {})]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    check_vllm_shape(carrying[0].choices[0].model_extra["prompt_logprobs"], ids, logprobs, 1)  # type: ignore[index]

    messages = [{"role": "user", "content": "Say something nice."}]
    stream = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=3, stream=True, extra_body={"prompt_logprobs": 0}
    )
    chat_chunks = list(stream)
    carrying_chat = [c for c in chat_chunks if "prompt_logprobs" in (c.model_extra or {})]
    assert len(carrying_chat) == 1 and carrying_chat[0] is chat_chunks[0]
    tok = Tokenizer(model)
    assert len(carrying_chat[0].model_extra["prompt_logprobs"]) == len(
        tok.encode(tok.apply_chat_template(messages))
    )


def test_echo_with_n_samples_gives_every_choice_its_prompt(
    client: openai.OpenAI, expected: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = expected
    out = client.completions.create(
        model="llama",
        prompt=[ids, ids[:4]],
        echo=True,
        logprobs=0,
        max_tokens=0,
        n=2,
        temperature=1.0,
        seed=3,
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        prompt = ids if choice.index < 2 else ids[:4]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            reference_logprobs(prompt, logprobs), abs=1e-4
        )
    assert out.usage is not None and out.usage.completion_tokens == 0


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_assembles_to_the_unstreamed_answer(client: openai.OpenAI, max_tokens: int) -> None:
    """vLLM's streamed echo: each choice's first chunk leads with its prompt (and, with
    logprobs, the prompt's tokens first); the chunks join to the unstreamed choice."""
    kwargs: dict[str, Any] = {
        "model": "llama",
        "prompt": [PROMPT, "Two"],
        "echo": True,
        "max_tokens": max_tokens,
    }
    kwargs |= {"temperature": 0, "logprobs": 1, "n": 2}
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    token_logprobs: dict[int, list[float | None]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens or [])
                token_logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs or [])
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert texts[choice.index].startswith(PROMPT if choice.index < 2 else "Two")
        assert choice.logprobs is not None
        assert tokens[choice.index] == choice.logprobs.tokens
        assert token_logprobs[choice.index] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
