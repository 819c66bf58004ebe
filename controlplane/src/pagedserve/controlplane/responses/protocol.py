"""The Responses API request (pydantic) and its translation into a chat-completions request.

Accepted: `model`, `input` (a string, or a list of items: messages with roles user, assistant,
system, developer and text content; `function_call` and `function_call_output` items;
`reasoning` items, which are dropped), `instructions`, `tools` (function tools) with
`tool_choice` and `parallel_tool_calls`, `text.format` (text, json_object, json_schema: the
chat path's structured output), `max_output_tokens`, `temperature`, `top_p`, `stream`,
`store`, `previous_response_id`, `metadata` (echoed; at most 16 string pairs). Fields that
would change the answer and are not implemented (`background`, `conversation`, `prompt`,
`top_logprobs`, `max_tool_calls`) are refused with 400 naming them; other unknown fields are
ignored.

A request that continues a stored response puts that response's conversation (its input and
output, not its instructions, as OpenAI has it) before its own input. Refusals name the field
as the client wrote it (`input[2].call_id`); what the chat path refuses later is renamed back
by `Translated.renamed`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.controlplane.errors import clip, invalid_argument, json_type
from pagedserve.controlplane.openai.protocol import ChatCompletionRequest
from pagedserve.controlplane.openai.translated import TranslatedChat
from pagedserve.controlplane.tools.definitions import MAX_CALL_ID_CHARS, MAX_TOOLS, TOOL_NAME

REFUSED = ("background", "conversation", "prompt", "top_logprobs", "max_tool_calls")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16
MAX_ID_CHARS = 256


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so REFUSED fields can be seen

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass
class Translated(TranslatedChat):
    """The chat request a Responses request became; `conversation` is the part of its messages
    a later request continuing it repeats (all but the instructions); `origins[i]` is the field
    chat message `i` came from."""

    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    origins: list[str] = field(default_factory=list)

    def field_name(self, chat_field: str) -> str:
        match = re.match(r"messages\[(\d+)\](.*)", chat_field)
        if match is not None and int(match.group(1)) < len(self.origins):
            origin = self.origins[int(match.group(1))]
            return origin + (".content" if match.group(2).startswith(".content") and "[" in origin else "")
        match = re.match(r"tools\[(\d+)\]\.function(.*)", chat_field)
        if match is not None:
            return f"tools[{match.group(1)}]{match.group(2)}"
        if chat_field.startswith("response_format"):
            return "text.format" + chat_field.removeprefix("response_format").replace(".json_schema", "", 1)
        renames = {"max_tokens": "max_output_tokens", "tool_choice.function.name": "tool_choice.name"}
        return renames.get(chat_field, chat_field)


def check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise invalid_argument(f"metadata: at most {MAX_METADATA} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise invalid_argument(
                "metadata: keys of at most 64 characters, values strings of at most 512", "metadata"
            )


def translate(body: ResponsesRequest, history: list[dict[str, Any]]) -> Translated:
    """The chat request that runs `body` after the stored conversation `history` (empty when
    it continues none); raises INVALID_ARGUMENT naming the field."""
    extra = body.model_extra or {}
    for name in REFUSED:
        if extra.get(name):
            raise invalid_argument(f"{name}: not supported by this server", name)
    check_metadata(body.metadata)
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    messages += history
    origins += ["previous_response_id"] * len(history)
    own = _input_messages(body.input, origins)
    messages += own
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools[: MAX_TOOLS + 1])]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _text_format(text_format)
    try:
        return Translated(ChatCompletionRequest.model_validate(chat), [*history, *own], origins)
    except ValidationError as exc:  # (every value was checked above: a safety net, not a path)
        raise invalid_argument(f"the request is not valid: {clip(str(exc), 200)}") from None


def _input_messages(value: str | list[Any], origins: list[str]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        origins.append("input")
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_argument(f"{at}: must be an object, got {json_type(item)}", at)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, at))
            origins.append(at)
        elif kind == "function_call":
            call = _function_call(item, at)
            if out and out[-1]["role"] == "assistant" and origins[-1] != "previous_response_id":
                out[-1].setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                origins.append(at)
        elif kind == "function_call_output":
            call_id = _id(item, "call_id", at)
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            origins.append(at)
        elif kind != "reasoning":  # (a reasoning trace sent back is not part of the prompt)
            got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
            raise invalid_argument(
                f"{at}.type: must be message, function_call, function_call_output or reasoning, got {got}",
                f"{at}.type",
            )
    if not out:
        raise invalid_argument("input: must hold at least one message", "input")
    return out


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        got = repr(clip(role, 32)) if isinstance(role, str) else json_type(role)
        raise invalid_argument(
            f"{at}.role: must be one of {', '.join(MESSAGE_ROLES)}, got {got}", f"{at}.role"
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{at}.content")
    return {"role": role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise invalid_argument(
            f"{where}: must be a string or a list of text parts, got {json_type(parts)}", where
        )
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
            raise invalid_argument(f"{at}.type: only text parts are supported, got {got}", f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise invalid_argument(f"{at}.text: must be a string", f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def _id(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_CALL_ID_CHARS:
        name = f"{at}.{key}"
        raise invalid_argument(f"{name}: must be a string of 1 to {MAX_CALL_ID_CHARS} characters", name)
    return value


def _function_call(item: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = _id(item, "call_id", at)
    name = item.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid_argument(
            f"{at}.name: must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -", f"{at}.name"
        )
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise invalid_argument(f"{at}.arguments: must be a string (JSON text)", f"{at}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(tool: Any, at: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid_argument(f"{at}: must be an object, got {json_type(tool)}", at)
    kind = tool.get("type")
    if kind != "function":
        got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
        raise invalid_argument(f"{at}.type: only function tools are supported, got {got}", f"{at}.type")
    function = {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # (none, auto, required: checked by the chat path)
    if choice.get("type") != "function":
        kind = choice.get("type")
        got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
        raise invalid_argument(f"tool_choice.type: only function is supported, got {got}", "tool_choice.type")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _text_format(value: Any) -> dict[str, Any]:
    """`text.format` as the chat path's `response_format`."""
    if not isinstance(value, dict):
        raise invalid_argument(f"text.format: must be an object, got {json_type(value)}", "text.format")
    if value.get("type") != "json_schema":
        return value  # text, json_object (others: refused by the chat path, renamed)
    spec = {k: value[k] for k in ("name", "schema", "strict", "description") if k in value}
    return {"type": "json_schema", "json_schema": spec}
