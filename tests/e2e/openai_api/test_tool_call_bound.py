"""Forced tool calls are bounded (real servers, a tiny random-weight model): with
`tool_choice: "required"` and parallel calls allowed, the grammar holds an answer to the
server's `--max-tool-calls`, streamed or not, and a choice that reaches the bound says so
(`stop_reason: "max_tool_calls"`, `finish_reason` "tool_calls": its calls are whole and valid)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.hardening.tiny_served import Http, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

BOUND = 3
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Paris"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


def serve(model: Path, bound: int) -> Iterator[Http]:
    config = engine_config(model, num_blocks=64, max_model_len=1024)
    srv = ServerThread(config, model, max_tool_calls=bound)
    try:
        yield Http(srv.http_url, timeout_s=300)
    finally:
        srv.close()


@pytest.fixture(scope="module")
def http(model: Path) -> Iterator[Http]:
    yield from serve(model, BOUND)


def never_closing(model: Path) -> dict[str, int]:
    """A logit_bias that all but bans every token holding `]`: the model then keeps adding
    calls (the grammar offers only `,` or `]` after one) until the grammar allows nothing but
    `]`, the runaway of a model that does not stop calling."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
    return {str(i): -100 for token, i in vocab.items() if "]" in token}


def chat(http: Http, stream: bool, seed: int, **extra: Any) -> list[dict[str, Any]]:
    """The choice(s) of a forced, parallel call request: the message (or, streamed, the calls
    assembled from the deltas) plus its finish fields."""
    body = {
        **extra,
        "messages": [{"role": "user", "content": "Weather in Oslo and Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": seed,
        "stream": stream,
    }
    reply = http.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        return [{**choice, "calls": choice["message"]["tool_calls"]}]
    calls: dict[int, dict[str, str]] = {}
    last: dict[str, Any] = {}
    for line in reply.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            for delta in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += delta["function"].get("name", "")
                call["arguments"] += delta["function"]["arguments"]
            if choice["finish_reason"] is not None:
                last = choice
    return [{**last, "calls": list(calls.values())}]


def check_calls(calls: list[dict[str, Any]]) -> None:
    for call in calls:
        name = call["function"]["name"] if "function" in call else call["name"]
        arguments = call["function"]["arguments"] if "function" in call else call["arguments"]
        assert name == "get_weather" and json.loads(arguments)["city"] in ("Oslo", "Paris")


@pytest.mark.parametrize("stream", [True, False])
def test_a_model_that_keeps_calling_stops_at_the_bound(http: Http, model: Path, stream: bool) -> None:
    for seed in range(2):
        (choice,) = chat(http, stream, seed, logit_bias=never_closing(model))
        assert len(choice["calls"]) == BOUND, choice["calls"]
        check_calls(choice["calls"])
        assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", "max_tool_calls"), choice


@pytest.mark.parametrize("stream", [True, False])
def test_fewer_calls_than_the_bound_have_no_stop_reason(http: Http, stream: bool) -> None:
    for seed in range(2):
        (choice,) = chat(http, stream, seed)
        assert 1 <= len(choice["calls"]) < BOUND, choice["calls"]  # (this model closes after one)
        check_calls(choice["calls"])
        assert choice["finish_reason"] == "tool_calls" and "stop_reason" not in choice, choice


def test_a_bound_of_one_call_is_reached_every_time(model: Path) -> None:
    for http in serve(model, 1):
        for stream in (True, False):
            (choice,) = chat(http, stream, seed=0)
            assert len(choice["calls"]) == 1
            assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", "max_tool_calls")


def test_the_same_model_without_a_low_bound_calls_until_its_context_is_full(model: Path) -> None:
    for http in serve(model, 1024):
        (choice,) = chat(http, True, seed=0, logit_bias=never_closing(model))
        assert len(choice["calls"]) > BOUND and choice["finish_reason"] == "length", choice
