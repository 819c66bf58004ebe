"""The tools a chat request declares and how it lets the model use them, validated once for
both protocols (the OpenAI routes read JSON into these, the gRPC servicer reads protobuf).

OpenAI's shape: `tools` is a list of `{"type": "function", "function": {"name", "description",
"parameters", "strict"}}`; `tool_choice` is "none", "auto", "required" or
`{"type": "function", "function": {"name": ...}}`; `parallel_tool_calls` (default true) allows
more than one call in one answer. Unset `tool_choice` means "auto" when tools are given and
"none" otherwise, as OpenAI has it.

Everything here is bounded before a grammar is built or a template rendered: the number of
tools, the length of names and descriptions, each parameters schema (the structured-output
limits of `pagedserve.common.constraints`) and all of them together. Errors are `InvalidField`
naming the field as the caller's protocol names it (the caller passes the prefix).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.common.constraints import MAX_CONSTRAINT_CHARS, normalize_json_schema
from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.errors import json_type

MAX_TOOLS = 128
"""The most tools one request may declare."""
MAX_DESCRIPTION_CHARS = 8192
"""The longest description of one tool."""
MAX_TOOLS_SCHEMA_CHARS = 4 * MAX_CONSTRAINT_CHARS
"""The most characters all tools' parameters schemas may have together (each has its own
structured-output limit too): they all go into the prompt, and `required` compiles them into
one grammar."""
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function name: a-z, A-Z, 0-9, underscores and dashes, 64 at most."""
DEFAULT_MAX_TOOL_CALLS = 16
"""The most calls a forced "required" answer may hold when parallel calls are allowed (the
server's --max-tool-calls): the grammar closes the array there."""
MAX_TOOL_CALLS_LIMIT = 1024
"""The largest --max-tool-calls a server may set."""
CHOICE_MODES = ("none", "auto", "required", "function")
"""`function`: the model must call the one named tool."""
ANY_OBJECT_SCHEMA = '{"type":"object"}'
"""The parameters of a tool that declares none: any JSON object (OpenAI's reading)."""


@dataclass(frozen=True)
class Tool:
    """One function the model may call. `parameters` is its JSON Schema as compact JSON text
    (key order kept)."""

    name: str
    description: str = ""
    parameters: str = ANY_OBJECT_SCHEMA

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates read it (transformers' `apply_chat_template(tools=...)`):
        OpenAI's JSON shape, the schema parsed."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"
    name: str = ""  # the tool a "function" choice names

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (and the tools go into the prompt)."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """Whether a grammar makes the answer a call ("required" or a named function)."""
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, choice and parallel-call rule, checked together."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True
    max_calls: int = DEFAULT_MAX_TOOL_CALLS  # a forced parallel answer's bound (the server's)

    @property
    def bounded_calls(self) -> int | None:
        """The most calls the forcing grammar allows, or None when no grammar counts them."""
        if self.choice.mode != "required":
            return None
        return self.max_calls if self.parallel else 1

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)


NO_TOOLS = ToolUse((), ToolChoice("none"))


def make_tool(name: object, description: object, parameters: object, where: str) -> Tool:
    """One tool from its parts; `where` names it (e.g. "tools[2].function"). `parameters`: a
    JSON Schema as a dict or its JSON text; None or "" for none."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        got = repr(name[:32]) if isinstance(name, str) else type(name).__name__
        raise InvalidField(
            f"{where}.name", f"must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {got}"
        )
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidField(f"{where}.description", f"must be a string, got {type(description).__name__}")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise InvalidField(f"{where}.description", f"must be at most {MAX_DESCRIPTION_CHARS} characters")
    _check_unicode(description, f"{where}.description")
    if parameters is None or parameters == "":
        schema = ANY_OBJECT_SCHEMA
    else:
        schema = normalize_json_schema(parameters, f"{where}.parameters")
        _check_unicode(schema, f"{where}.parameters")
    return Tool(name, description, schema)


def make_tool_use(
    tools: list[Tool], choice: ToolChoice | None, parallel: bool | None, where: str = "tools"
) -> ToolUse:
    """The request's tool use: the default choice applied, names unique, a named choice among
    the tools, the schemas' total bounded. `where` names the tools list."""
    if len(tools) > MAX_TOOLS:
        raise InvalidField(where, f"must list at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidField(
                f"{where}[{i}]", f"declares {tool.name!r} a second time: tool names must be unique"
            )
        seen.add(tool.name)
    total = sum(len(t.parameters) + len(t.description) for t in tools)
    if total > MAX_TOOLS_SCHEMA_CHARS:
        raise InvalidField(
            where, f"must total at most {MAX_TOOLS_SCHEMA_CHARS} characters of schemas and descriptions"
        )
    if choice is None:
        choice = ToolChoice("auto" if tools else "none")
    if choice.mode not in CHOICE_MODES:
        raise InvalidField(
            "tool_choice", f"must be one of none, auto, required or a function, got {choice.mode!r}"
        )
    if choice.mode != "none" and not tools:
        raise InvalidField("tool_choice", f"is {choice.mode!r} but the request declares no tools")
    if choice.mode == "function" and choice.name not in seen:
        raise InvalidField(
            "tool_choice", f"names {choice.name[:64]!r}, which is not among the request's tools"
        )
    return ToolUse(tuple(tools), choice, True if parallel is None else parallel)


def parse_openai_tools(body: dict[str, Any]) -> ToolUse:
    """`tools`, `tool_choice` and `parallel_tool_calls` of an OpenAI chat request body (its
    top-level fields); raises InvalidField naming the field as the client wrote it."""
    raw_tools = body.get("tools")
    if raw_tools is None:
        raw_tools = []
    if not isinstance(raw_tools, list):
        raise InvalidField("tools", f"must be a list of tools, got {json_type(raw_tools)}")
    if len(raw_tools) > MAX_TOOLS:
        raise InvalidField("tools", f"must list at most {MAX_TOOLS} tools, got {len(raw_tools)}")
    tools = [_openai_tool(item, f"tools[{i}]") for i, item in enumerate(raw_tools)]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidField("parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}")
    return make_tool_use(tools, _openai_choice(body.get("tool_choice")), parallel)


def _openai_tool(item: object, where: str) -> Tool:
    if not isinstance(item, dict):
        raise InvalidField(where, f"must be an object, got {json_type(item)}")
    kind = item.get("type", "function")
    if kind != "function":
        got = repr(kind[:32]) if isinstance(kind, str) else json_type(kind)
        raise InvalidField(f"{where}.type", f"must be 'function', got {got}")
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidField(f"{where}.function", f"must be an object with a name, got {json_type(function)}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidField(f"{where}.function.strict", f"must be a boolean, got {json_type(strict)}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidField(
            f"{where}.function.parameters", f"must be a JSON Schema object, got {json_type(parameters)}"
        )
    return make_tool(function.get("name"), function.get("description"), parameters, f"{where}.function")


def _openai_choice(value: object) -> ToolChoice | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidField(
                "tool_choice", f"must be none, auto, required or a function object, got {value[:32]!r}"
            )
        return ToolChoice(value)
    if not isinstance(value, dict):
        raise InvalidField("tool_choice", f"must be a string or an object, got {json_type(value)}")
    if value.get("type", "function") != "function":
        raise InvalidField("tool_choice.type", "must be 'function'")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidField("tool_choice.function.name", "must be set: the name of one of the request's tools")
    return ToolChoice("function", name)


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidField(
            where, f"is not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None


MAX_CALL_ID_CHARS = 256
"""The longest tool-call id a conversation may send back."""


def history_tool_calls(role: str, calls: Sequence[tuple[str, str, str]], where: str) -> list[dict[str, Any]]:
    """An earlier assistant message's calls, each (id, name, arguments JSON text), checked and
    in the shape chat templates read (OpenAI's); `where` names the message's calls field."""
    if not calls:
        return []
    if role != "assistant":
        raise InvalidField(where, "may only be set on an assistant message")
    if len(calls) > MAX_TOOLS:
        raise InvalidField(where, f"must list at most {MAX_TOOLS} calls, got {len(calls)}")
    out = []
    for i, (call_id, name, arguments) in enumerate(calls):
        if not TOOL_NAME.fullmatch(name):
            raise InvalidField(
                f"{where}[{i}].function.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -"
            )
        if len(call_id) > MAX_CALL_ID_CHARS:
            raise InvalidField(f"{where}[{i}].id", f"must be at most {MAX_CALL_ID_CHARS} characters")
        _check_unicode(arguments, f"{where}[{i}].function.arguments")
        out.append(
            {
                "id": call_id or f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out
