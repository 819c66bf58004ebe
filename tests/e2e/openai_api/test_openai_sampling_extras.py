"""vLLM's sampling extras end to end (tiny random model with a tokenizer): `min_tokens`,
`allowed_token_ids`, `bad_words`, `include_stop_str_in_output` and `truncate_prompt_tokens` from the official
`openai` client's `extra_body` and from the Python gRPC client are honoured, and every bad
value is refused naming its field."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from pagedserve.clients.python import GenerationClient, StreamChunk
from pagedserve.controlplane.tokenizer import Tokenizer
from tests.e2e.hardening.tiny_served import VOCAB, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

PROMPT = "Hello world, the capital of France is"
EOS = 2  # the tiny served model's </s>
MESSAGES = [{"role": "user", "content": "hi"}]


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


def test_http_allowed_token_ids(client: openai.OpenAI, model: Path) -> None:
    tok = Tokenizer(model)
    token = tok.encode(" Paris")[0]
    extra = {"allowed_token_ids": [token], "ignore_eos": True}
    out = client.completions.create(
        model="llama", prompt=PROMPT, max_tokens=5, temperature=0, extra_body=extra
    )
    assert out.choices[0].text == tok.decode([token] * 5)
    chat = client.chat.completions.create(
        model="llama",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        extra_body=extra,
    )
    assert chat.choices[0].message.content == tok.decode([token] * 4)


def test_http_min_tokens(client: openai.OpenAI) -> None:
    extra: dict[str, Any] = {"logit_bias": {str(EOS): 100}}  # EOS would be every token's argmax
    out = client.completions.create(
        model="llama", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra
    )
    assert out.usage is not None and out.usage.completion_tokens == 1
    extra["min_tokens"] = 6
    out = client.completions.create(
        model="llama", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 7  # 6, then EOS
    chat = client.chat.completions.create(
        model="llama",
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        extra_body=extra,
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 7


def test_http_include_stop_str_in_output(client: openai.OpenAI) -> None:
    plain = dict(model="llama", prompt=PROMPT, max_tokens=12, temperature=0)
    text = client.completions.create(**plain, extra_body={"ignore_eos": True}).choices[0].text  # type: ignore[call-overload]
    stop = text[4:6]
    at = text.find(stop)
    for include, expected in ((False, text[:at]), (True, text[: at + len(stop)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        out = client.completions.create(**plain, stop=[stop], extra_body=extra)  # type: ignore[call-overload]
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        chunks = client.completions.create(**plain, stop=[stop], stream=True, extra_body=extra)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_http_truncate_prompt_tokens(client: openai.OpenAI, model: Path) -> None:
    tail = Tokenizer(model).encode(PROMPT)[-3:]
    plain = dict(model="llama", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    expected = client.completions.create(prompt=tail, **plain).choices[0].text  # type: ignore[call-overload]
    extra = {"ignore_eos": True, "truncate_prompt_tokens": 3}
    out = client.completions.create(**{**plain, "extra_body": extra}, prompt=PROMPT)  # type: ignore[call-overload]
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == expected
    # echo and prompt logprobs show the prompt as kept
    extra = {"truncate_prompt_tokens": 3, "prompt_logprobs": 0}
    echo = client.completions.create(
        model="llama", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0, extra_body=extra
    )
    assert echo.choices[0].text == Tokenizer(model).decode(tail, skip_special_tokens=False)
    assert len(echo.choices[0].logprobs.token_logprobs) == 3  # type: ignore[union-attr]
    assert len(echo.choices[0].model_extra["prompt_logprobs"]) == 3  # type: ignore[index]
    chat = client.chat.completions.create(
        model="llama",
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 2},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 2


def test_http_bad_words(client: openai.OpenAI, model: Path) -> None:
    tok = Tokenizer(model)
    plain = dict(model="llama", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    out = client.completions.create(**plain, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    tokens = out.choices[0].logprobs.tokens
    # A generated token that is a whole word whose ban names that very token: it never comes back.
    token = next(
        t
        for t in tokens
        if t.strip().isalnum() and len(tok.encode(t)) == 1 and occurring(tok, [t.strip()], tok.encode(t))
    )
    extra = {"ignore_eos": True, "bad_words": [token.strip()]}
    banned = client.completions.create(**plain, extra_body=extra)  # type: ignore[call-overload]
    assert token not in banned.choices[0].logprobs.tokens and len(banned.choices[0].logprobs.tokens) == 12


def occurring(tok: Tokenizer, words: list[str], ids: list[int]) -> list[tuple[int, ...]]:
    """The token sequences `words` ban (tokenized as the server does) that occur in `ids`."""
    from pagedserve.controlplane.bad_words import bad_words_token_ids

    sequences = bad_words_token_ids(tok.encode, words, "bad_words")
    return [seq for seq in sequences if any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids)))]


def post(server: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    host, port = server.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(2000))}, "allowed_token_ids"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"bad_words": "cat"}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x" * 257]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2**40}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "field"), BAD_VALUES)
def test_http_bad_values_are_400_naming_the_field(
    server: ServerThread, path: str, extra: dict[str, Any], field: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4, **extra}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"].split("[")[0] == field, answer  # an element: its index too


def test_grpc_extras(server: ServerThread) -> None:
    with GenerationClient(server.grpc_address, timeout=60) as client:
        items = client.generate_stream(
            PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=[7, 9]
        )
        ids = [t for i in items if isinstance(i, StreamChunk) for t in i.token_ids]
        assert len(ids) == 8 and set(ids) <= {7, 9}
        [done] = client.generate(
            PROMPT, max_tokens=20, temperature=0.0, min_tokens=5, logit_bias={EOS: 100.0}
        )
        assert done.completion_tokens == 6 and done.finish_reason == "stop"
        greedy: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        [whole] = client.generate(PROMPT, **greedy)
        stop = whole.text[4:6]
        at = whole.text.find(stop)
        [kept] = client.generate(
            PROMPT,
            max_tokens=10,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        )
        assert kept.text == whole.text[: at + len(stop)] and kept.stop_string == stop
        ids = [
            t
            for i in client.generate_stream(PROMPT, **greedy)
            if isinstance(i, StreamChunk)
            for t in i.token_ids
        ]
        # A two-token word the output holds (as the server tokenizes it): banned, it never comes back.
        tok = Tokenizer(server.controlplane.dispatcher.config.model)
        pairs = [tok.decode(ids[i : i + 2]) for i in range(len(ids) - 1)]
        word = next(w for w in pairs if w.strip() and any(len(q) == 2 for q in occurring(tok, [w], ids)))
        items = client.generate_stream(PROMPT, **greedy, bad_words=[word])
        banned = [t for i in items if isinstance(i, StreamChunk) for t in i.token_ids]
        assert len(banned) == 10 and not occurring(tok, [word], banned), (word, banned)
        [short] = client.generate(PROMPT, max_tokens=2, truncate_prompt_tokens=3)
        assert short.prompt_tokens == 3
        for kwargs, field in [
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ({"bad_words": [""]}, "bad_words[0]"),
            ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
            ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
            ({"allowed_token_ids": list(range(2000))}, "allowed_token_ids"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, **{"max_tokens": 4, **kwargs})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"sampling_params.{field}" in err.value.details()
