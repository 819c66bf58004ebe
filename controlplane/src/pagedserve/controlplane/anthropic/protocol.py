"""The Messages API request (pydantic) and its translation into a chat-completions request.

Accepted: `model`, `messages` (roles user and assistant; content a string or blocks of type
text, tool_use, tool_result; thinking blocks sent back are dropped), `max_tokens` (required),
`system` (a string or text blocks), `stop_sequences`, `stream`, `temperature`, `top_p`,
`top_k`, `tools` (custom tools: name, description, input_schema) and `tool_choice` (auto, any,
tool, none; `disable_parallel_tool_use`), `output_config.format` (a json_schema: structured
output; `effort` is ignored), `metadata` (ignored). Extended thinking, MCP servers
and containers are refused with 400 naming them; other unknown fields are ignored.

The translation is checked block by block here, so a refusal names the field as the client
wrote it (`messages[2].content[1].tool_use_id`); what the chat path refuses later (a template
or size limit, a tool schema) names the chat request's field, which `Translated.renamed`
maps back to this API's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.controlplane.errors import clip, invalid_argument, json_type
from pagedserve.controlplane.openai.protocol import ChatCompletionRequest
from pagedserve.controlplane.openai.translated import TranslatedChat
from pagedserve.controlplane.tools.definitions import MAX_CALL_ID_CHARS, MAX_TOOLS, TOOL_NAME

REFUSED = ("thinking", "mcp_servers", "container")
"""Fields that would change the answer and that this server does not implement (refused when
set to anything but their off value)."""
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's tool_choice types -> OpenAI's (`tool` names one function)."""


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Any]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so REFUSED fields can be seen

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = 1


@dataclass
class Translated(TranslatedChat):
    """The chat request a Messages request became, and where each of its messages came from
    (`origins[i]`: the Messages field that chat message `i` was made of)."""

    chat: ChatCompletionRequest
    origins: list[str] = field(default_factory=list)

    def field_name(self, chat_field: str) -> str:
        match = re.match(r"messages\[(\d+)\](.*)", chat_field)
        if match is not None and int(match.group(1)) < len(self.origins):
            return self.origins[int(match.group(1))] + _rest(match.group(2))
        match = re.match(r"tools\[(\d+)\]\.function(.*)", chat_field)
        if match is not None:
            rest = match.group(2).replace(".parameters", ".input_schema", 1)
            return f"tools[{match.group(1)}]{rest}"
        if chat_field.startswith("response_format"):
            return "output_config.format" + chat_field.removeprefix("response_format").replace(
                ".json_schema", "", 1
            )
        return {"stop": "stop_sequences", "tool_choice.function.name": "tool_choice.name"}.get(
            chat_field, chat_field
        )


def _rest(rest: str) -> str:
    # A chat message's content is the Messages block's text; its calls are the tool_use blocks.
    return ".content" if rest.startswith(".content") else rest


def translate(body: MessagesRequest) -> Translated:
    """The chat-completions request that runs `body`; raises INVALID_ARGUMENT naming the field."""
    extra = body.model_extra or {}
    for name in REFUSED:
        value = extra.get(name)
        if value and not (isinstance(value, dict) and value.get("type") == "disabled"):
            raise invalid_argument(f"{name}: not supported by this server", name)
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
        origins.append("system")
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        for out, origin in _messages(message, where):
            messages.append(out)
            origins.append(origin)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools[: MAX_TOOLS + 1])]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    output_format = (body.output_config or {}).get("format")
    if output_format is not None:
        chat["response_format"] = _output_format(output_format)
    try:
        return Translated(ChatCompletionRequest.model_validate(chat), origins)
    except ValidationError as exc:  # (every value was checked above: a safety net, not a path)
        raise invalid_argument(f"the request is not valid: {clip(str(exc), 200)}") from None


def _messages(message: AnthropicMessage, where: str) -> list[tuple[dict[str, Any], str]]:
    """The chat messages one Messages message becomes, each with its origin: tool results
    become `tool` messages (in their order), the rest one user or assistant message."""
    if isinstance(message.content, str):
        return [({"role": message.role, "content": message.content}, where)]
    out: list[tuple[dict[str, Any], str]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a reasoning trace sent back: not part of the prompt
        elif kind == "tool_use":
            if message.role != "assistant":
                raise invalid_argument(
                    f"{at}.type: tool_use blocks belong to assistant messages", f"{at}.type"
                )
            calls.append(_tool_use(block, at))
        elif kind == "tool_result":
            if message.role != "user":
                raise invalid_argument(f"{at}.type: tool_result blocks belong to user messages", f"{at}.type")
            out.append((_tool_result(block, at), at))
        else:
            raise invalid_argument(
                f"{at}.type: only text, tool_use and tool_result blocks are supported, got {clip(kind, 32)!r}",
                f"{at}.type",
            )
    if texts or calls or not out:
        chat: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            chat["tool_calls"] = calls
        out.append((chat, where))
    return out


def _block_type(block: Any, at: str) -> str:
    if not isinstance(block, dict):
        raise invalid_argument(f"{at}: must be a content block object, got {json_type(block)}", at)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise invalid_argument(f"{at}.type: must be a string, got {json_type(kind)}", f"{at}.type")
    return kind


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise invalid_argument(f"{at}.{key}: must be a string, got {json_type(value)}", f"{at}.{key}")
    return value


def _text_of(value: str | list[Any], where: str) -> str:
    """A string, or the text of a list of text blocks (system, a tool result's content)."""
    if isinstance(value, str):
        return value
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
        if kind != "text":
            raise invalid_argument(
                f"{at}.type: only text blocks are supported here, got {clip(kind, 32)!r}", f"{at}.type"
            )
        texts.append(_string(block, "text", at))
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = _string(block, "id", at)
    if len(call_id) > MAX_CALL_ID_CHARS:
        raise invalid_argument(f"{at}.id: at most {MAX_CALL_ID_CHARS} characters", f"{at}.id")
    name = _string(block, "name", at)
    if not TOOL_NAME.fullmatch(name):
        raise invalid_argument(
            f"{at}.name: must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -", f"{at}.name"
        )
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise invalid_argument(f"{at}.input: must be an object, got {json_type(arguments)}", f"{at}.input")
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = _string(block, "tool_use_id", at)
    if len(call_id) > MAX_CALL_ID_CHARS:
        name = f"{at}.tool_use_id"
        raise invalid_argument(f"{name}: at most {MAX_CALL_ID_CHARS} characters", name)
    content = block.get("content", "")
    if not isinstance(content, str | list):
        name = f"{at}.content"
        raise invalid_argument(f"{name}: must be a string or text blocks, got {json_type(content)}", name)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        name = f"{at}.is_error"
        raise invalid_argument(f"{name}: must be a boolean, got {json_type(is_error)}", name)
    text = _text_of(content, f"{at}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}


def _tool(tool: Any, at: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid_argument(f"{at}: must be an object, got {json_type(tool)}", at)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
        raise invalid_argument(f"{at}.type: only custom tools are supported, got {got}", f"{at}.type")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        name = f"{at}.input_schema"
        raise invalid_argument(f"{name}: must be a JSON Schema object, got {json_type(schema)}", name)
    function = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _output_format(value: Any) -> dict[str, Any]:
    """`output_config.format` (structured outputs) as the chat path's `response_format`."""
    where = "output_config.format"
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise invalid_argument(f"{where}: must be an object of type json_schema", where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": value.get("schema")}}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise invalid_argument(
                "tool_choice.name: must be set: the name of one of the tools", "tool_choice.name"
            )
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif isinstance(kind, str) and kind in TOOL_CHOICES:
        out["tool_choice"] = TOOL_CHOICES[kind]
    else:
        got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
        raise invalid_argument(
            f"tool_choice.type: must be auto, any, tool or none, got {got}", "tool_choice.type"
        )
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            name = "tool_choice.disable_parallel_tool_use"
            raise invalid_argument(f"{name}: must be a boolean, got {json_type(disable)}", name)
        out["parallel_tool_calls"] = not disable
    return out
