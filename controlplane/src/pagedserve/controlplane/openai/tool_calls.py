"""Tool calls in OpenAI's chat shapes: one output parser per choice, read as the text streams.

A response's tool calls come out of `pagedserve.controlplane.tools.parsers`: the model family's format
for `tool_choice: "auto"`, the forced JSON for "required" and a named function. The same parser
runs whether the client streams or not, so a streamed answer's `delta.tool_calls` (the call's
index, id and name once, then its arguments in pieces) always assemble to the message's
`tool_calls` of the same answer unstreamed. `finish_reason` is "tool_calls" when an answer that
was not cut short by `max_tokens` holds a call; a forced answer that holds as many calls as the
server's `--max-tool-calls` allows (the grammar closed it there) says so in `stop_reason`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.common.invalid_field import InvalidField
from pagedserve.common.log import get_logger
from pagedserve.controlplane.errors import clip, invalid_argument
from pagedserve.controlplane.openai.structured import Structured
from pagedserve.controlplane.reasoning import ChoiceReasoning, reasoning_fields
from pagedserve.controlplane.tools.definitions import DEFAULT_MAX_TOOL_CALLS, ToolUse, parse_openai_tools
from pagedserve.controlplane.tools.output import CompletionParsers, finish_reason
from pagedserve.controlplane.tools.parsers import ParserOutput, ToolCallDelta

log = get_logger(__name__)

MAX_TOOL_CALLS_REASON = "max_tool_calls"
"""The `stop_reason` of a choice whose calls reached the bound (vLLM's field for what ended it;
`finish_reason` stays "tool_calls", so clients run the calls, which are whole and valid)."""


class ChoiceToolCalls:
    """The parsers of one response's choices (created on a choice's first text)."""

    def __init__(self, use: ToolUse, model_format: str) -> None:
        self._use = use
        self._parser = CompletionParsers(use, model_format)

    def feed(self, index: int, text: str) -> dict[str, Any]:
        """The delta of a streamed chunk with `text` newly generated (content and/or calls)."""
        return _delta(self._parser(index).feed(text))

    def finish(self, index: int) -> dict[str, Any]:
        """What the parser held back, as the delta of the choice's last chunk."""
        return _delta(self._parser(index).finish())

    def has_calls(self, index: int) -> bool:
        return bool(self._parser(index).tool_calls)

    def num_calls(self, index: int) -> int:
        return len(self._parser(index).tool_calls)

    def ends(self, index: int, reason: str) -> dict[str, Any]:
        """The choice's finish fields, `reason` being "stop" or "length": `finish_reason`, and
        `stop_reason` when its calls reached the bound (`ToolUse.bounded_calls`) of a request
        that allowed more than one."""
        calls = self.num_calls(index)
        out: dict[str, Any] = {"finish_reason": finish_reason(reason, calls > 0)}
        bound = self._use.bounded_calls
        if self._use.parallel and bound is not None and calls >= bound:
            out["stop_reason"] = MAX_TOOL_CALLS_REASON
            log.info("tool_calls_bounded", index=index, calls=calls, max_tool_calls=bound)
        return out

    def message(self, index: int, text: str) -> dict[str, Any]:
        """The unstreamed answer's message: the text parsed whole."""
        parser = self._parser(index)
        parser.feed(text)
        parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": parser.content or None}
        if parser.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parser.tool_calls
            ]
        else:
            message["content"] = parser.content
        return message


def _delta(out: ParserOutput) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if out.content:
        delta["content"] = out.content
    if out.calls:
        delta["tool_calls"] = _merged(out.calls)
    return delta


def _merged(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's `delta.tool_calls`: one entry per call, its pieces of this chunk joined."""
    entries: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = entries.get(d.index)
        if entry is None:
            entry = {"index": d.index, "function": {"arguments": ""}}
            if d.id is not None:
                entry["id"] = d.id
                entry["type"] = "function"
            if d.name is not None:
                entry["function"] = {"name": d.name, "arguments": ""}
            entries[d.index] = entry
        entry["function"]["arguments"] += d.arguments
    return list(entries.values())


def tool_use_of(
    fields: Mapping[str, Any], structured: Structured, max_calls: int = DEFAULT_MAX_TOOL_CALLS
) -> ToolUse:
    """The tools and tool_choice a request body's top-level `fields` set, under the server's
    bound on calls; a forced call with a structured output is refused (both would constrain
    the same text)."""
    try:
        use = dataclasses.replace(parse_openai_tools(dict(fields)), max_calls=max_calls)
    except InvalidField as exc:
        raise invalid_argument(f"{exc.field} {clip(exc.reason, 200)}", exc.field) from None
    if use.choice.forced and structured.constraint is not None:
        source = next(iter(structured.field_names.values()), "response_format")
        raise invalid_argument(
            f"tool_choice: a forced tool call ({use.choice.mode}) cannot be combined with {source}",
            "tool_choice",
        )
    return use


class ChoiceOutput:
    """How one response's answers are read: the reasoning section split out first (with a
    reasoning parser), then the rest through the tool-call parser (when the model may call
    tools), else the text as content. Deltas and messages are in OpenAI's chat shapes."""

    def __init__(self, calls: ChoiceToolCalls | None, reasoning: ChoiceReasoning | None) -> None:
        self.calls, self.reasoning = calls, reasoning

    def feed(self, index: int, text: str) -> dict[str, Any]:
        """The delta of a streamed chunk with `text` newly generated."""
        if self.reasoning is None:
            return {"content": text} if self.calls is None else self.calls.feed(index, text)
        thought, text = self.reasoning.feed(index, text)
        return {**reasoning_fields(thought), **self._content(index, text)}

    def finish(self, index: int) -> dict[str, Any]:
        """What the parsers held back, as the delta of the choice's last chunk."""
        if self.reasoning is None:
            return {} if self.calls is None else self.calls.finish(index)
        thought, text = self.reasoning.finish(index)
        delta = {**reasoning_fields(thought), **self._content(index, text)}
        return delta if self.calls is None else {**delta, **_joined(delta, self.calls.finish(index))}

    def message(self, index: int, text: str) -> dict[str, Any]:
        """The unstreamed answer's message: the text parsed whole."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        if self.calls is None:
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            message = self.calls.message(index, text)
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = thought or None
        return message

    def _content(self, index: int, text: str) -> dict[str, Any]:
        if self.calls is not None:
            return self.calls.feed(index, text) if text else {}
        return {"content": text} if text else {}


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two deltas of one chunk as one (contents appended, calls listed in order)."""
    out = dict(second)
    if "content" in first and "content" in second:
        out["content"] = first["content"] + second["content"]
    if "tool_calls" in first and "tool_calls" in second:
        out["tool_calls"] = first["tool_calls"] + second["tool_calls"]
    return out
