"""`/v1/responses` driven by the official `openai` client against a real server (tiny
random-weight model): greedy output equals the chat-completions answer to the same prompt;
`responses.stream` sends the Responses event sequence with consecutive sequence numbers and
assembles to the unstreamed response; `text.format` json_schema output validates; a forced
function call -> function_call_output round trip; `previous_response_id` over two turns equals
the chat answer to the whole conversation; GET and DELETE; another API key's response is 404;
with the store disabled `store` and `previous_response_id` are 400; bad fields are 400
naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from pagedserve.controlplane.config import ControlPlaneConfig
from tests.e2e.agents_api.conftest import CONTEXT, KEY, OTHER_KEY
from tests.e2e.hardening.tiny_served import Http
from tests.e2e.harness import ServerThread, engine_config

SYSTEM = "Be brief."
QUESTION = "Say hello."
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather.",
    "parameters": SCHEMA,
}
JSON_FORMAT: Any = {"format": {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}}


def client_for(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return client_for(server, KEY)


def chat_text(client: openai.OpenAI, model: Path, messages: list[Any], max_tokens: int) -> Any:
    return client.chat.completions.create(
        model=str(model), messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_create_equals_the_chat_completion_of_the_same_prompt(client: openai.OpenAI, model: Path) -> None:
    out = client.responses.create(
        model=str(model), input=QUESTION, instructions=SYSTEM, max_output_tokens=12, temperature=0
    )
    chat = chat_text(
        client, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 12
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert out.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert out.usage.total_tokens == chat.usage.total_tokens
    items = client.responses.create(
        model=str(model),
        instructions=SYSTEM,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12,
        temperature=0,
    )
    assert items.output_text == out.output_text


def test_stream_sends_the_event_sequence_with_sequence_numbers(client: openai.OpenAI, model: Path) -> None:
    kwargs: Any = {"model": str(model), "input": QUESTION, "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output[0].content[0].text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_json_schema_text_format_validates_streamed_or_not(client: openai.OpenAI, model: Path) -> None:
    kwargs: Any = {"model": str(model), "input": "Forecast?", "max_output_tokens": 64, "temperature": 0}
    out = client.responses.create(**kwargs, text=JSON_FORMAT)
    assert out.status == "completed", out
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    with client.responses.stream(**kwargs, text=JSON_FORMAT) as stream:
        final = stream.get_final_response()
    assert final.output_text == out.output_text
    loose = client.responses.create(**kwargs, text={"format": {"type": "json_object"}})
    assert loose.status in ("completed", "incomplete")


def test_function_call_then_output_round_trip(client: openai.OpenAI, model: Path) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: Any = {
        "model": str(model),
        "input": question,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 48,
        "temperature": 0,
    }
    out = client.responses.create(**kwargs)
    assert out.status == "completed"
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    follow = [
        *question,
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": calls[0].name,
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"},
    ]
    answer = client.responses.create(model=str(model), input=follow, tools=[WEATHER], max_output_tokens=8)
    assert answer.status in ("completed", "incomplete")
    required = client.responses.create(
        **{**kwargs, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 96}
    )
    assert [item.type for item in required.output] == ["function_call"]


def test_previous_response_id_two_turns_get_and_delete(
    server: ServerThread, client: openai.OpenAI, model: Path
) -> None:
    first = client.responses.create(
        model=str(model), input=QUESTION, max_output_tokens=6, temperature=0, store=True
    )
    second = client.responses.create(
        model=str(model),
        input="And again?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
        store=True,
    )
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again?"},
    ]
    assert second.output_text == chat_text(client, model, conversation, 6).choices[0].message.content
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    other = client_for(server, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        other.responses.create(
            model=str(model), input="x", previous_response_id=second.id, max_output_tokens=2
        )
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model=str(model), input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # stateless by default
        client.responses.retrieve(unstored.id)


def test_with_the_store_disabled_store_and_previous_response_id_are_400(model: Path) -> None:
    srv = ServerThread(
        engine_config(model, num_blocks=64, max_model_len=CONTEXT), model, responses_store_max_entries=0
    )
    try:
        client = client_for(srv, "unused")
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as refused:
            client.responses.create(
                model=str(model), input="x", previous_response_id="resp_1", max_output_tokens=2
            )
        assert refused.value.param == "previous_response_id"
        with pytest.raises(openai.BadRequestError, match="store"):
            client.responses.create(model=str(model), input="x", store=True, max_output_tokens=2)
        assert (
            client.responses.create(model=str(model), input="x", max_output_tokens=2).output_text is not None
        )
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input[0].call_id"),
        ({"input": []}, "input"),
        ({"input": "a\ud800"}, "input"),
        ({"instructions": "a\ud800"}, "instructions"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"background": True}, "background"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"previous_response_id": "x" * 300}, "previous_response_id"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    server: ServerThread, model: Path, change: dict[str, Any], param: str
) -> None:
    http = Http(server.http_url)
    for stream in (False, True):
        body = {"model": str(model), "input": QUESTION, "max_output_tokens": 2, "stream": stream, **change}
        reply = http.request(
            "POST",
            "/v1/responses",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        )
        assert reply.status == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param, error
        assert param in error["message"], error


def test_a_restarted_control_plane_answers_404_for_old_ids(model: Path) -> None:
    """The store is in the control plane's memory (documented): a new control plane in front
    of the same data plane knows no earlier response."""
    srv = ServerThread(engine_config(model, num_blocks=64, max_model_len=CONTEXT), model)
    try:
        kept = client_for(srv, "unused").responses.create(
            model=str(model), input=QUESTION, max_output_tokens=2, store=True
        )
        assert client_for(srv, "unused").responses.retrieve(kept.id).id == kept.id
        srv._run(srv.controlplane.stop())
        config = ControlPlaneConfig(model=str(model), dataplanes=(srv.dataplane.address,))
        srv.controlplane = srv._run(ServerThread._start_cp(config))
        srv.http_url = f"http://127.0.0.1:{srv.controlplane.http_port}"
        with pytest.raises(openai.NotFoundError):
            client_for(srv, "unused").responses.retrieve(kept.id)
    finally:
        srv.close()
