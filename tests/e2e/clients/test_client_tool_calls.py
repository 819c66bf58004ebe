"""Tool calling from the Python client over gRPC (docs/api.md, "Tool calling over gRPC").

Against a real server on the default model: `tool_choice="required"` and a named function give
calls that parse and validate under their tool's schema, with finish_reason "tool_calls", sync
and asyncio; `parallel_tool_calls=False` gives one call; a conversation that sends back a call
and its result is accepted; bad tools fail with INVALID_ARGUMENT naming the protobuf field.
Without a server: the keywords fill the wire's `ChatMessages`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pydantic
import pytest

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient, build_request
from pagedserve.clients.python.tools import ToolCall
from pagedserve.protos.pagedserve.v1 import generation_pb2
from tests.e2e.harness import ServerThread, engine_config

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}


class Search(pydantic.BaseModel):
    query: str = pydantic.Field(max_length=40)


SEARCH = {"name": "search", "description": "Search the web.", "parameters": Search}
ASK: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_keywords_fill_the_chat_message() -> None:
    request = build_request(
        ASK, tools=[WEATHER, SEARCH], tool_choice={"name": "search"}, parallel_tool_calls=False
    )
    chat = request.chat
    assert [t.name for t in chat.tools] == ["get_weather", "search"]
    assert json.loads(chat.tools[0].parameters) == WEATHER_PARAMETERS
    assert json.loads(chat.tools[1].parameters) == Search.model_json_schema()
    assert chat.tool_choice.mode == generation_pb2.ToolChoice.MODE_FUNCTION
    assert chat.tool_choice.function_name == "search"
    assert chat.HasField("parallel_tool_calls") and chat.parallel_tool_calls is False
    assert (
        build_request(ASK, tool_choice="required").chat.tool_choice.mode
        == generation_pb2.ToolChoice.MODE_REQUIRED
    )
    assert not build_request(ASK).chat.HasField("parallel_tool_calls")
    history = build_request(
        [
            *ASK,
            {"role": "assistant", "tool_calls": [ToolCall("call_1", "get_weather", '{"city": "Paris"}')]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    ).chat.messages
    assert history[1].tool_calls[0].name == "get_weather" and history[2].tool_call_id == "call_1"
    with pytest.raises(ValueError, match="need a chat prompt"):
        build_request("text prompt", tools=[WEATHER])
    with pytest.raises(ValueError, match="tool_choice must be"):
        build_request(ASK, tool_choice="sometimes")


@pytest.fixture(scope="module")
def server(default_model_path: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(default_model_path), default_model_path)
    yield srv
    srv.close()


@pytest.mark.real_model
def test_forced_calls_parse_and_validate(server: ServerThread) -> None:
    with GenerationClient(server.grpc_address, timeout=120) as client:
        (out,) = client.generate(
            ASK, max_tokens=96, temperature=0.0, tools=[WEATHER, SEARCH], tool_choice="required"
        )
        assert out.finish_reason == "tool_calls", out
        assert out.tool_calls and out.content == ""
        for call in out.tool_calls:
            assert call.id.startswith("call_") and call.name in ("get_weather", "search")
            schema = WEATHER_PARAMETERS if call.name == "get_weather" else Search.model_json_schema()
            jsonschema.validate(json.loads(call.arguments), schema)
        (one,) = client.generate(
            ASK,
            max_tokens=96,
            temperature=0.0,
            tools=[WEATHER, SEARCH],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        assert len(one.tool_calls) == 1
        (named,) = client.generate(
            ASK, max_tokens=96, temperature=0.0, tools=[WEATHER, SEARCH], tool_choice={"name": "search"}
        )
        assert [c.name for c in named.tool_calls] == ["search"] and named.finish_reason == "tool_calls"
        Search.model_validate_json(named.tool_calls[0].arguments)
        answer_prompt = [
            *ASK,
            {"role": "assistant", "tool_calls": one.tool_calls},
            {"role": "tool", "tool_call_id": one.tool_calls[0].id, "content": "18 degrees"},
        ]
        (answer,) = client.generate(
            answer_prompt, max_tokens=16, temperature=0.0, tools=[WEATHER], tool_choice="none"
        )
        assert answer.tool_calls == [] and answer.text

    async def streamed() -> Any:
        async with AsyncGenerationClient(server.grpc_address, timeout=120) as client:
            (out,) = await client.generate(
                ASK, max_tokens=96, temperature=0.0, tools=[WEATHER], tool_choice={"name": "get_weather"}
            )
            return out

    out = asyncio.run(streamed())
    assert out.finish_reason == "tool_calls" and out.tool_calls[0].name == "get_weather"
    assert out.tool_calls[0].arguments == out.text.strip()  # a named call's text is its arguments
    jsonschema.validate(json.loads(out.tool_calls[0].arguments), WEATHER_PARAMETERS)
    server.wait_idle()


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tools": [{"name": "bad name"}]}, "prompt.chat.tools[0].name"),
        ({"tool_choice": "required"}, "prompt.chat.tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"name": "nope"}}, "prompt.chat.tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "json_object": True}, "prompt.chat.tool_choice"),
        (
            {"tools": [{"name": "r", "parameters": {"$ref": "#/$defs/none"}}], "tool_choice": "required"},
            "prompt.chat.tools",
        ),
    ],
)
def test_bad_tools_are_invalid_argument_naming_the_field(
    server: ServerThread, kwargs: dict[str, Any], field: str
) -> None:
    with GenerationClient(server.grpc_address, timeout=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(ASK, max_tokens=4, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
