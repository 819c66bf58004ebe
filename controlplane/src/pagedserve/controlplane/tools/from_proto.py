"""A gRPC chat request's tools and conversation, read into the values the OpenAI routes build
from JSON (so both protocols validate and render them alike). Field names in errors are the
protobuf paths (`prompt.chat.tools[2].name`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.common.constraints import Constraint
from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.errors import clip, invalid_argument
from pagedserve.controlplane.tools.definitions import (
    MAX_CALL_ID_CHARS,
    Tool,
    ToolChoice,
    ToolUse,
    history_tool_calls,
    make_tool,
    make_tool_use,
)
from pagedserve.controlplane.tools.forced import forced_constraint
from pagedserve.protos.pagedserve.v1 import generation_pb2

CHAT = "prompt.chat"
_MODES = {
    generation_pb2.ToolChoice.MODE_NONE: "none",
    generation_pb2.ToolChoice.MODE_AUTO: "auto",
    generation_pb2.ToolChoice.MODE_REQUIRED: "required",
    generation_pb2.ToolChoice.MODE_FUNCTION: "function",
}


def chat_tool_use(chat: generation_pb2.ChatMessages) -> ToolUse:
    try:
        tools: list[Tool] = [
            make_tool(t.name, t.description, t.parameters or None, f"{CHAT}.tools[{i}]")
            for i, t in enumerate(chat.tools)
        ]
        choice = None
        if (
            chat.HasField("tool_choice")
            and chat.tool_choice.mode != generation_pb2.ToolChoice.MODE_UNSPECIFIED
        ):
            mode = _MODES.get(chat.tool_choice.mode)
            if mode is None:
                raise InvalidField(
                    "tool_choice.mode", f"must be a ToolChoice.Mode, got {chat.tool_choice.mode}"
                )
            choice = ToolChoice(mode, chat.tool_choice.function_name)
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
        return make_tool_use(tools, choice, parallel, f"{CHAT}.tools")
    except InvalidField as exc:
        raise _named(exc) from None


def chat_messages(chat: generation_pb2.ChatMessages) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        where = f"{CHAT}.messages[{i}]"
        try:
            calls = history_tool_calls(
                m.role, [(c.id, c.name, c.arguments) for c in m.tool_calls], f"{where}.tool_calls"
            )
        except InvalidField as exc:
            raise _named(exc) from None
        if calls:
            message["tool_calls"] = calls
        if m.tool_call_id:
            if len(m.tool_call_id) > MAX_CALL_ID_CHARS:
                raise invalid_argument(
                    f"{where}.tool_call_id: at most {MAX_CALL_ID_CHARS} characters", f"{where}.tool_call_id"
                )
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def forced_tool_constraint(use: ToolUse, sampling: Mapping[str, object]) -> tuple[Constraint, str] | None:
    """The constraint a forced tool choice puts on the output and the field a compile refusal
    names; a request that also sets its own constraint is refused."""
    try:
        forced = forced_constraint(use)
    except InvalidField as exc:
        raise _named(exc) from None
    if forced is None:
        return None
    if sampling.get("constraint") is not None:
        name = f"{CHAT}.tool_choice"
        raise invalid_argument(
            f"{name}: a forced tool call ({use.choice.mode}) cannot be combined with a sampling_params constraint",
            name,
        )
    constraint, where = forced
    # forced_constraint names OpenAI's fields: tools, or tools[i].function.parameters
    return constraint, f"{CHAT}.{where.replace('.function.', '.')}"


def _named(exc: InvalidField) -> Exception:
    name = exc.field if exc.field.startswith(CHAT) else f"{CHAT}.{exc.field}"
    return invalid_argument(f"{name} {clip(exc.reason, 200)}", name)
