"""The OpenAI-compatible API, driven by the official `openai` package against real servers
(real default model): a streaming chat client written for vLLM works unchanged; non-streaming,
n, stop, seed, max_completion_tokens, logprobs, usage; errors in OpenAI's JSON with the
right status; a client that disconnects mid-stream frees its KV blocks."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import openai
import pytest

from pagedserve.common.models import DEFAULT_MODEL, resolve_model_path
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.dataplane import LLM, SamplingParams
from tests.e2e.harness import ServerThread, engine_config

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline() -> dict[str, list[int]]:
    llm = LLM(DEFAULT_MODEL, num_threads=1)
    params = SamplingParams(max_tokens=24, temperature=0)
    return {
        "chat": llm.chat(QUESTION, params, use_tqdm=False)[0].token_ids,
        "completion": llm.generate(["The capital of France is"], params, use_tqdm=False)[0].token_ids,
    }


@pytest.fixture(scope="module")
def server(offline: dict[str, list[int]]) -> Iterator[ServerThread]:
    srv = ServerThread(
        engine_config(DEFAULT_MODEL, num_blocks=512, max_model_len=2048), DEFAULT_MODEL, max_queue_len=2
    )
    yield srv
    srv.close()


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model_path(DEFAULT_MODEL))


def test_streaming_chat_example_works_unchanged(
    client: openai.OpenAI, server: ServerThread, offline: dict[str, list[int]]
) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, stream=True, max_tokens=24, temperature=0
    )
    pieces, reasons = [], []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == tokenizer().decode(offline["chat"])
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
    server.wait_idle()


def test_non_streaming_chat_and_usage(client: openai.OpenAI, offline: dict[str, list[int]]) -> None:
    tok = tokenizer()
    out = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_completion_tokens=24, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tok.decode(offline["chat"])
    assert out.choices[0].finish_reason == "stop"
    usage = out.usage
    assert usage is not None
    assert usage.completion_tokens == len(offline["chat"])
    assert usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(QUESTION)))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_stream_with_usage_n_seed_and_stop(
    client: openai.OpenAI, offline: dict[str, list[int]]
) -> None:
    tok = tokenizer()
    expected = tok.decode(offline["completion"])
    out = client.completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=24, temperature=0
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"

    stream = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="The capital of France is",
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24

    # continuous_usage_stats (vLLM's; guidellm sends it): the usage so far on every chunk.
    running = list(
        client.completions.create(
            model=DEFAULT_MODEL,
            prompt="The capital of France is",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert "".join(c.choices[0].text for c in running if c.choices) == expected
    assert all(c.usage is not None for c in running)
    so_far = [c.usage.completion_tokens for c in running if c.usage is not None]
    assert so_far == sorted(so_far) and so_far[0] >= 1 and so_far[-1] == 24
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert {c.usage.prompt_tokens for c in running if c.usage is not None} == {prompt_tokens}
    assert running[-1].usage is not None and running[-1].usage.total_tokens == prompt_tokens + 24

    word = expected.split()[2]
    stopped = client.completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, stop=[word]
    )
    assert stopped.choices[0].text == expected[: expected.index(word)]
    assert stopped.choices[0].finish_reason == "stop"

    a = client.completions.create(
        model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3, n=2
    )
    b = client.completions.create(
        model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3, n=2
    )
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage is not None and a.usage.completion_tokens == 16

    many = client.completions.create(
        model=DEFAULT_MODEL,
        prompt=["The capital of France is", "Once upon a time"],
        max_tokens=4,
        temperature=0,
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == tok.decode(offline["completion"][:4])


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.token == item.top_logprobs[0].token  # greedy picks the top one
    legacy = client.completions.create(
        model=DEFAULT_MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=1
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 3 and len(lp.token_logprobs or []) == 3


@pytest.mark.parametrize(
    ("kwargs", "status", "param_in_message"),
    [
        ({"temperature": -1.0}, 400, "temperature"),
        ({"top_p": 2.0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ],
)
def test_errors_use_openai_json_and_status(
    client: openai.OpenAI, kwargs: dict[str, object], status: int, param_in_message: str
) -> None:
    args: dict[str, object] = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**args)  # type: ignore[call-overload]
    assert err.value.status_code == status
    body = err.value.body
    assert isinstance(body, dict) and param_in_message in str(body.get("message", ""))


def test_models_endpoint(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL]


def test_client_disconnect_mid_stream_frees_blocks(server: ServerThread) -> None:
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "Count to one thousand:",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    aborted_before = server.wait_idle().snapshot.stats.num_aborted_requests
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    for _ in range(8):
        response.readline()
    assert [r.num_prompt_tokens for r in server.state().requests]  # still generating
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    idle = server.wait_idle(timeout_s=10)
    assert idle.snapshot.stats.num_aborted_requests == aborted_before + 1
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
