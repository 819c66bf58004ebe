"""Tool definitions, tool_choice, the forced-call schema and the tools' way into the prompt.
Model-free: the schema is compiled by the grammar backend itself to show it is one it reads."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest

from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.tools.definitions import (
    ANY_OBJECT_SCHEMA,
    DEFAULT_MAX_TOOL_CALLS,
    MAX_TOOLS,
    Tool,
    ToolChoice,
    make_tool_use,
    parse_openai_tools,
)
from pagedserve.controlplane.tools.forced import forced_constraint, required_schema
from pagedserve.controlplane.tools.prompt import resolve_parser, template_inputs, template_reads_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TREE = {
    "type": "function",
    "function": {
        "name": "plant",
        "parameters": {
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}},
            "required": ["root"],
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["label"],
                }
            },
        },
    },
}


def _field(body: dict[str, object]) -> str:
    with pytest.raises(InvalidField) as exc:
        parse_openai_tools(body)
    return exc.value.field


def test_default_choice_follows_the_tools() -> None:
    assert parse_openai_tools({}).choice == ToolChoice("none")
    use = parse_openai_tools({"tools": [WEATHER]})
    assert use.choice == ToolChoice("auto") and use.parallel is True
    assert use.tools[0].name == "get_weather"
    assert json.loads(use.tools[0].parameters)["required"] == ["city"]
    named = parse_openai_tools(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named.choice == ToolChoice("function", "get_weather") and named.choice.forced
    assert parse_openai_tools({"tools": [WEATHER], "parallel_tool_calls": False}).parallel is False


def test_a_tool_without_parameters_takes_any_object() -> None:
    use = parse_openai_tools({"tools": [{"type": "function", "function": {"name": "now"}}]})
    assert use.tools[0].parameters == ANY_OBJECT_SCHEMA


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": ["x"]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "a", "parameters": []}}]},
            "tools[1].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]},
            "tools[0].function.description",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
            "tools",
        ),
    ],
)
def test_bad_tools_are_refused_by_field(body: dict[str, object], field: str) -> None:
    assert _field(body) == field


def test_a_deep_parameters_schema_is_refused_by_its_field() -> None:
    deep: dict[str, object] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    assert _field({"tools": [tool]}) == "tools[0].function.parameters"


def test_named_choice_constrains_to_the_parameters() -> None:
    use = parse_openai_tools(
        {"tools": [WEATHER, TREE], "tool_choice": {"type": "function", "function": {"name": "plant"}}}
    )
    forced = forced_constraint(use)
    assert forced is not None
    constraint, where = forced
    assert where == "tools[1].function.parameters"
    assert constraint.kind == "json_schema" and json.loads(constraint.value) == TREE["function"]["parameters"]  # type: ignore[index]
    assert forced_constraint(parse_openai_tools({"tools": [WEATHER]})) is None


def test_required_schema_validates_calls_and_compiles() -> None:
    import xgrammar

    use = parse_openai_tools({"tools": [WEATHER, TREE], "tool_choice": "required"})
    schema = required_schema(use)
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "plant", "arguments": {"root": {"label": "a", "kids": [{"label": "b"}]}}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
        [{"name": "plant", "arguments": {"root": {"kids": []}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # The tool's own $defs moved under the root, its refs rewritten (also the recursive one).
    assert set(schema["$defs"]) == {"tool0", "tool1", "tool1_node"}
    assert schema["$defs"]["tool1_node"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool1_node"}
    forced = forced_constraint(use)
    assert forced is not None and forced[1] == "tools"
    xgrammar.Grammar.from_json_schema(forced[0].value, any_whitespace=False, strict_mode=True)


def test_one_call_only_without_parallel_calls() -> None:
    use = parse_openai_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    schema = required_schema(use)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], schema)
    parallel = required_schema(parse_openai_tools({"tools": [WEATHER], "tool_choice": "required"}))
    assert parallel["maxItems"] == DEFAULT_MAX_TOOL_CALLS == 16


def test_parallel_calls_are_bounded_by_the_servers_max_tool_calls() -> None:
    use = parse_openai_tools({"tools": [WEATHER], "tool_choice": "required"})
    use = dataclasses.replace(use, max_calls=3)
    schema = required_schema(use)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    jsonschema.validate([call] * 3, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call] * 4, schema)
    forced = forced_constraint(use)
    assert forced is not None
    import xgrammar  # (as above: heavy, imported where a test needs it)

    xgrammar.Grammar.from_json_schema(forced[0].value, any_whitespace=False, strict_mode=True)


def test_root_and_property_refs_are_moved() -> None:
    tool = Tool(
        "t",
        "",
        json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}, "c": {"$ref": "#"}},
            }
        ),
    )
    schema = required_schema(make_tool_use([tool], ToolChoice("required"), None))
    props = schema["$defs"]["tool0"]["properties"]
    assert props["b"] == {"$ref": "#/$defs/tool0/properties/a"}
    assert props["c"] == {"$ref": "#/$defs/tool0"}


CHATML_WITH_TOOLS = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}</tool_call>{% endfor %}|{% endfor %}"
)


def test_templates_that_read_tools_get_them_as_openai_json() -> None:
    use = parse_openai_tools({"tools": [WEATHER]})
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    inputs, tools = template_inputs(messages, use, CHATML_WITH_TOOLS)
    assert tools == [WEATHER]
    assert inputs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # parsed for the template
    assert inputs[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'  # caller's copy intact
    none = parse_openai_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert template_inputs(messages, none, CHATML_WITH_TOOLS)[1] is None


def test_templates_without_tools_get_the_hermes_prompt() -> None:
    use = parse_openai_tools({"tools": [WEATHER]})
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "warm", "tool_call_id": "c2"},
    ]
    inputs, tools = template_inputs(messages, use, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools is None
    assert inputs[0]["role"] == "system" and '"name": "get_weather"' in inputs[0]["content"]
    assert "<tool_call>" in inputs[0]["content"]
    assert inputs[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert inputs[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>",
    }
    with_system = template_inputs([{"role": "system", "content": "Be brief."}, *messages[:1]], use, None)[0]
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2


def test_parser_follows_the_template() -> None:
    assert template_reads_tools("{% if tools %}x{% endif %}") and not template_reads_tools("{{ toolsy }}")
    assert resolve_parser("auto", None) == "hermes"
    assert resolve_parser("auto", "{{ tools }}[TOOL_CALLS]") == "mistral"
    assert resolve_parser("auto", "{{ tools }}<|python_tag|>") == "llama3_json"
    assert resolve_parser("auto", "{{ tools }}<tool_call>") == "hermes"
    assert resolve_parser("auto", "[TOOL_CALLS] and no variable") == "hermes"
    assert resolve_parser("mistral", None) == "mistral"
