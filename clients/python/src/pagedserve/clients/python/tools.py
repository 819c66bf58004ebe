"""Tool calling in a GenerateRequest: tools, tool choice and a conversation's earlier calls in
the wire's `ChatMessages`, from OpenAI-shaped dicts; a completion's calls as `ToolCall`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.clients.python.constraints import json_schema_text
from pagedserve.protos.pagedserve.v1 import generation_pb2


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a completion (OpenAI's `tool_calls[i]`): `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


ToolSpec = Mapping[str, Any]
"""A tool: OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`,
or the function part alone; `parameters` a JSON Schema dict, its text or a pydantic model."""
_TOOL_MODES = {
    "none": generation_pb2.ToolChoice.MODE_NONE,
    "auto": generation_pb2.ToolChoice.MODE_AUTO,
    "required": generation_pb2.ToolChoice.MODE_REQUIRED,
}


def tool_message(tool: ToolSpec) -> generation_pb2.Tool:
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or "name" not in function:
        raise ValueError("tools: each tool needs a name (OpenAI's {'type': 'function', 'function': {...}})")
    parameters = function.get("parameters")
    return generation_pb2.Tool(
        name=function["name"],
        description=function.get("description") or "",
        parameters="" if parameters is None else json_schema_text(parameters),
    )


def tool_choice_message(choice: str | Mapping[str, Any]) -> generation_pb2.ToolChoice:
    """ "none", "auto", "required", or a function: {"name": ...} or OpenAI's
    {"type": "function", "function": {"name": ...}}."""
    if isinstance(choice, str):
        if choice not in _TOOL_MODES:
            raise ValueError(f"tool_choice must be none, auto, required or {{'name': ...}}, got {choice!r}")
        return generation_pb2.ToolChoice(mode=_TOOL_MODES[choice])
    function = choice.get("function", choice)
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice: a function choice needs its name")
    return generation_pb2.ToolChoice(mode=generation_pb2.ToolChoice.MODE_FUNCTION, function_name=name)


def chat_message(message: Mapping[str, Any]) -> generation_pb2.ChatMessage:
    """A chat message (OpenAI's shape: an assistant's `tool_calls`, a tool's `tool_call_id`;
    a ToolCall of an earlier Completion is accepted as a call too)."""
    out = generation_pb2.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_call_id=message.get("tool_call_id") or "",
    )
    for call in message.get("tool_calls") or ():
        if isinstance(call, ToolCall):
            out.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
            continue
        function = call.get("function", call)
        arguments = function.get("arguments", "")
        out.tool_calls.add(
            id=call.get("id") or "",
            name=function["name"],
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
    return out
