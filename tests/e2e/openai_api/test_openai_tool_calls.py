"""Tool calling through the official `openai` client against a real server (real default
model): `tool_choice` "required" and a named function are forced by a grammar, so every call
parses and its arguments validate against the tool's schema (greedy and sampled);
`parallel_tool_calls=false` gives exactly one call; a streamed answer's `delta.tool_calls`
assemble to the unstreamed answer's calls; tools reach the prompt; a conversation with earlier
calls and tool results is accepted; bad tools are a 400 naming the field; the server returns
every KV block afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from pagedserve.common.models import DEFAULT_MODEL
from tests.e2e.harness import ServerThread, engine_config

pytestmark = pytest.mark.real_model

MAX_TOKENS = 160

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH: Any = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 40},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query", "limit"],
        },
    },
}
FLIGHT: Any = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "description": "Book a flight.",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {"$ref": "#/$defs/route"},
                "passengers": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 16},
                    "minItems": 1,
                    "maxItems": 2,
                },
                "class": {"enum": ["economy", "business"]},
            },
            "required": ["route", "passengers", "class"],
            "$defs": {
                "route": {
                    "type": "object",
                    "properties": {
                        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    },
                    "required": ["from", "to"],
                }
            },
        },
    },
}
TOOLS = [WEATHER, SEARCH, FLIGHT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TASKS = [
    "What is the weather in Paris?",
    "Find me three recipes for pancakes.",
    "Book a flight from JFK to LHR for Ann.",
    "Is it raining in Tokyo right now?",
    "Search for the tallest building in the world.",
    "I need a business class seat from SFO to NRT for Bo and Cy.",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(DEFAULT_MODEL, num_blocks=512, max_model_len=2048), DEFAULT_MODEL)
    yield srv
    srv.close()


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(task: str) -> Any:
    return [{"role": "user", "content": task}]


def check_call(call: Any, names: set[str] | None = None) -> dict[str, Any]:
    """A call's arguments, checked: valid JSON under its tool's schema, a declared name."""
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name in (names or SCHEMAS)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def check_answer(choice: Any) -> None:
    """A forced answer: calls only, each valid; an answer cut short by max_tokens (this small
    model may repeat calls until then) has a valid prefix of its last call's arguments."""
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls
    if choice.finish_reason == "length":
        calls = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls", choice
    for call in calls:
        check_call(call)


def test_required_calls_parse_and_validate(client: openai.OpenAI, server: ServerThread) -> None:
    def run(task: str) -> Any:
        return client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=ask(task),
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )

    with ThreadPoolExecutor(len(TASKS)) as pool:
        responses = list(pool.map(run, TASKS))
    for response in responses:
        check_answer(response.choices[0])
    assert sum(r.choices[0].finish_reason == "tool_calls" for r in responses) >= len(TASKS) // 2
    stats = server.wait_idle().snapshot.stats
    assert stats.free_blocks == stats.total_blocks  # every block came back


def test_sampled_required_calls_validate(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=ask("Plan my trip: weather, flights and a search."),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        n=4,
    )
    for choice in response.choices:
        check_answer(choice)


def test_named_function_is_the_only_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=ask("Book a flight from JFK to LHR for Ann."),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "book_flight"}},
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and isinstance(calls[0], ChatCompletionMessageFunctionToolCall)
    assert calls[0].function.name == "book_flight"
    arguments = check_call(calls[0], {"book_flight"})
    assert set(arguments["route"]) == {"from", "to"}


def test_no_parallel_calls_means_one_call(client: openai.OpenAI) -> None:
    for task in TASKS[:3]:
        response = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=ask(task + " Also check the weather in Rome and search for hotels."),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls or []) == 1
        check_answer(choice)


def _assembled(stream: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    """The calls a stream's deltas assemble to, its finish reason and its content."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.get(delta.index)
                if call is None:  # the first delta of a call carries its id, type and name
                    assert delta.id and delta.type == "function" and delta.function.name
                    call = calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_deltas_assemble_to_the_unstreamed_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    for task in TASKS[:4]:
        kwargs: Any = dict(
            model=DEFAULT_MODEL,
            messages=ask(task),
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        streamed, finish, content = _assembled(client.chat.completions.create(stream=True, **kwargs))
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert [(c["name"], c["arguments"]) for c in streamed] == expected
        assert expected and finish == whole.finish_reason
        assert content == ""
        check_answer(whole)
        pieces = sum(1 for c in streamed for _ in c["arguments"])
        assert pieces > 0


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: str


def test_pydantic_tool_with_parse(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model=DEFAULT_MODEL,
        messages=ask("What is the weather in Oslo?"),
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    calls = completion.choices[0].message.tool_calls or []
    assert calls and calls[0].function.name == "Weather"
    parsed = calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and parsed.city


def _tokenize_count(server: ServerThread, messages: Any, tools: Any) -> int:
    """vLLM's /tokenize with tools: the ids a chat completion with those tools sees."""
    import urllib.request

    body = json.dumps({"model": DEFAULT_MODEL, "messages": messages, "tools": tools}).encode()
    request = urllib.request.Request(
        f"{server.http_url}/tokenize", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(json.loads(response.read())["count"])


def test_tools_reach_the_prompt_and_history_is_accepted(client: openai.OpenAI, server: ServerThread) -> None:
    def prompt_tokens(**kwargs: Any) -> int:
        response = client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=1, temperature=0.0, **kwargs
        )
        assert response.usage is not None
        return response.usage.prompt_tokens

    plain = prompt_tokens(messages=ask("What is the weather in Paris?"))
    with_tools = prompt_tokens(messages=ask("What is the weather in Paris?"), tools=TOOLS)
    hidden = prompt_tokens(messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="none")
    assert with_tools > plain + 100  # the tools' descriptions and schemas are in the prompt
    assert _tokenize_count(server, ask("What is the weather in Paris?"), TOOLS) == with_tools
    assert hidden < with_tools
    history: Any = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    assert prompt_tokens(messages=history, tools=TOOLS) > with_tools + 10
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0.0
    ).choices[0]
    assert answer.message.tool_calls is None and answer.message.content


def test_auto_answers_are_well_formed(client: openai.OpenAI) -> None:
    for task in TASKS[:3]:
        choice = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ask(task), tools=TOOLS, max_tokens=64, temperature=0.0
        ).choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert (
                    isinstance(call, ChatCompletionMessageFunctionToolCall) and call.function.name in SCHEMAS
                )
        else:
            assert choice.message.content is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "r", "parameters": {"$ref": "#/$defs/none"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    extra = dict(body)
    messages = extra.pop("messages", ask("hi"))
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=4, extra_body=extra)
    error: Any = exc.value.body
    error = error.get("error", error)
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    # the server goes on serving
    assert client.chat.completions.create(model=DEFAULT_MODEL, messages=ask("hi"), max_tokens=2).choices


HERMES_ANSWER = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "search_web", "arguments": {"query": "Paris events", "limit": 3}}\n'
    "</tool_call>"
)


def _tool_counters(server: ServerThread) -> dict[str, float]:
    """The control plane's tool metrics: auto requests and parsed calls."""
    import urllib.request

    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {"requests": 0.0, "calls": 0.0}
    for line in text.splitlines():
        if line.startswith('pagedserve_tool_requests_total{tool_choice="auto"}'):
            values["requests"] = float(line.split()[-1])
        elif line.startswith("pagedserve_tool_calls_total "):
            values["calls"] = float(line.split()[-1])
    return values


def test_auto_parses_the_models_own_format_streamed_and_not(
    client: openai.OpenAI, server: ServerThread
) -> None:
    """`auto` reads the Hermes format (the default model's template has no tools, so the
    fallback prompt teaches it). The answer is pinned with a `choice` constraint, so the
    parse is exact: content before the calls, two calls, deltas assembling to the same."""
    kwargs: Any = dict(
        model=DEFAULT_MODEL,
        messages=ask("What is the weather in Paris, and what is on there?"),
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": [HERMES_ANSWER]}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me check."
    calls = whole.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("search_web", {"query": "Paris events", "limit": 3}),
    ]
    for call in calls:
        check_call(call)
    before = _tool_counters(server)
    streamed, finish, content = _assembled(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == "Let me check."
    after = _tool_counters(server)
    assert after["requests"] == before["requests"] + 1 and after["calls"] == before["calls"] + 2
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
