"""`POST /v1/messages` driven by the official `anthropic` client against a real server (tiny
random-weight model): greedy text equals the chat-completions answer to the same prompt;
`messages.stream` sends Anthropic's event sequence and assembles to the unstreamed message;
stop sequences, a forced tool_use -> tool_result round trip (input valid under its schema,
streamed input_json_delta equal to the unstreamed input); x-api-key authenticates; errors are
Anthropic's error shape naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.e2e.agents_api.conftest import KEY
from tests.e2e.hardening.tiny_served import Http, Reply
from tests.e2e.harness import ServerThread

SYSTEM = "Be brief."
QUESTION = "Say hello."
GREEDY = {"temperature": 0}  # (the client has no sampling parameters: sent as extra fields)
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "input_schema": WEATHER_SCHEMA,
}


@pytest.fixture
def client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.http_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def chat_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server: ServerThread, body: Any, headers: dict[str, str], path: str = "/v1/messages") -> Reply:
    headers = {**headers, "content-type": "application/json"}
    return Http(server.http_url).request("POST", path, json.dumps(body), headers)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_create_equals_the_chat_completion_of_the_same_prompt(
    client: anthropic.Anthropic, chat_client: openai.OpenAI, model: Path
) -> None:
    out = client.messages.create(
        model=str(model), max_tokens=12, extra_body=GREEDY, system=SYSTEM, messages=user(QUESTION)
    )
    chat = chat_client.chat.completions.create(
        model=str(model),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert out.stop_reason == expected and out.stop_sequence is None
    assert chat.usage is not None
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    # system as text blocks is the same prompt
    blocks = client.messages.create(
        model=str(model),
        max_tokens=12,
        extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    assert blocks.content[0].text == out.content[0].text  # type: ignore[union-attr]


def test_stream_sends_the_event_sequence_and_assembles_to_the_message(
    client: anthropic.Anthropic, model: Path
) -> None:
    kwargs: Any = {"model": str(model), "max_tokens": 12, "extra_body": GREEDY, "messages": user(QUESTION)}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [k for k in kinds if k.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) <= {"content_block_delta", "text"}
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_end_the_text_and_are_reported(client: anthropic.Anthropic, model: Path) -> None:
    kwargs: Any = {"model": str(model), "max_tokens": 16, "extra_body": GREEDY, "messages": user(QUESTION)}
    text = client.messages.create(**kwargs).content[0].text
    stop = text[4:6]
    assert len(stop) == 2, text
    out = client.messages.create(**kwargs, stop_sequences=[stop, "\x01never"])
    assert out.content[0].text == text[: text.find(stop)]
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_then_tool_result_round_trip(client: anthropic.Anthropic, model: Path) -> None:
    forced: Any = {"type": "tool", "name": "get_weather"}
    kwargs: Any = {
        "model": str(model),
        "max_tokens": 48,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "tool_choice": forced,
        "messages": user("What is the weather in Paris?"),
    }
    out = client.messages.create(**kwargs)
    assert out.stop_reason == "tool_use", out
    calls = [b for b in out.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(c.name, c.input) for c in calls]
    assert final.stop_reason == "tool_use"
    # The call and its result go back; the model answers (any text: random weights).
    history: Any = [
        *kwargs["messages"],
        {"role": "assistant", "content": [c.model_dump() for c in out.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = client.messages.create(model=str(model), max_tokens=8, tools=[WEATHER], messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # "any" forces some call; "none" forbids one.
    anyone = client.messages.create(
        **{**kwargs, "max_tokens": 96, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    )
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].type == "tool_use"
    jsonschema.validate(anyone.content[-1].input, WEATHER_SCHEMA)
    none = client.messages.create(**{**kwargs, "tool_choice": {"type": "none"}, "max_tokens": 4})
    assert [b.type for b in none.content] == ["text"]


def test_x_api_key_authenticates_and_a_wrong_key_is_401_in_anthropics_shape(
    server: ServerThread, model: Path
) -> None:
    body = {"model": str(model), "max_tokens": 2, "messages": user(QUESTION)}
    ok = post(server, body, {"x-api-key": KEY})
    assert ok.status == 200, ok.text
    for headers in ({"x-api-key": "wrong"}, {}, {"x-api-key": KEY, "authorization": f"Bearer {KEY}"}):
        bad = post(server, body, headers)
        assert bad.status == 401
        assert bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "authentication_error"
    missing = post(server, body, {"x-api-key": KEY}, "/v1/messages/unknown")
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.http_url, api_key="wrong", max_retries=0).messages.create(
            model=str(model), max_tokens=2, messages=user(QUESTION)
        )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"system": [{"type": "text", "text": "a\ud800"}]}, "system"),
        ({"tools": [{"name": "f", "input_schema": "no"}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "f g", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
        ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5, "content": "x"}]}
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
    ],
)
def test_bad_fields_are_400_in_anthropics_shape_naming_the_field(
    server: ServerThread, model: Path, change: dict[str, Any], field: str
) -> None:
    body: dict[str, Any] = {"model": str(model), "max_tokens": 4, "messages": user(QUESTION), **change}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        reply = post(server, {**body, "stream": stream}, {"x-api-key": KEY})
        assert reply.status == 400, reply.text
        error = reply.json()
        assert set(error) == {"type", "error"} and error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"], error


def test_the_client_raises_bad_request_for_a_bad_field(client: anthropic.Anthropic, model: Path) -> None:
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        client.messages.create(
            model=str(model), max_tokens=4, messages=user(QUESTION), stop_sequences=["x" * 300]
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-unknown", max_tokens=4, messages=user(QUESTION))


def test_count_tokens_is_the_prompt_a_message_is_generated_from(
    client: anthropic.Anthropic, model: Path
) -> None:
    kwargs: Any = {"model": str(model), "system": SYSTEM, "messages": user(QUESTION), "tools": [WEATHER]}
    counted = client.messages.count_tokens(**kwargs)
    out = client.messages.create(**kwargs, max_tokens=1)
    assert counted.input_tokens == out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0)
    assert (
        client.messages.count_tokens(model=str(model), messages=user(QUESTION)).input_tokens
        < counted.input_tokens
    )
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        client.messages.count_tokens(
            model=str(model), messages=[{"role": "user", "content": [{"type": "image"}]}]
        )
