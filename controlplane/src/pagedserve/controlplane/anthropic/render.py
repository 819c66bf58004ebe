"""The Messages API's answers: the message object, and its stream of named events.

An answer's text and tool calls come out of the chat path's tool-call parser (the same one a
chat completion uses), so a streamed answer's blocks assemble to the unstreamed answer's
content. Content blocks: the reasoning (a thinking block, with a reasoning parser), the text (a text
block), then one tool_use block per call, its
`input` the call's arguments parsed. `stop_reason`: "tool_use" when an answer that was not cut
short holds a call, "max_tokens" when cut short, "stop_sequence" (with `stop_sequence`) when
a client's stop sequence ended it, else "end_turn". Usage follows Anthropic's split: prompt
tokens read from the prefix cache are `cache_read_input_tokens`, the others `input_tokens`.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.controlplane.frontend import CompletionDone
from pagedserve.controlplane.openai.running import SseEvent


def stop_reason(done: CompletionDone | None, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if done is None or done.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if done.stop_string:
        return "stop_sequence", done.stop_string
    return "end_turn", None


def usage(done: CompletionDone | None, prompt_tokens: int) -> dict[str, int]:
    cached = done.cached_tokens if done is not None else 0
    prompt = done.prompt_tokens if done is not None else prompt_tokens
    return {
        "input_tokens": prompt - cached,
        "output_tokens": done.completion_tokens if done is not None else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use `input`: the parsed object ({} when the model's JSON was
    cut short or is not an object: `input` must be one)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chat message (`content`, `tool_calls`) as Messages content blocks."""
    calls = message.get("tool_calls") or []
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in calls:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": tool_input(function["arguments"]),
            }
        )
    return blocks


def message_body(
    rid: str,
    model: str,
    blocks: list[dict[str, Any]],
    reason: tuple[str | None, str | None],
    use: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": use,
    }


class MessageStream:
    """The events of one streamed answer, from the chat path's deltas (`content` and
    `tool_calls` as a chat chunk has them). Only one block is open at a time: text, or the
    latest call (a parser emits a call's arguments before the next call begins)."""

    def __init__(self, rid: str, model: str, prompt_tokens: int) -> None:
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self.blocks = 0
        self.open: str | None = None  # "text" or "tool": the kind of the open block
        self.calls = 0
        self.texts = 0

    def start(self) -> list[SseEvent]:
        message = message_body(self.rid, self.model, [], (None, None), usage(None, self.prompt_tokens))
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def feed(self, delta: dict[str, Any]) -> list[SseEvent]:
        out: list[SseEvent] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                self.texts += 1
                out += self._begin("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                self.calls += 1
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._begin("tool", block)
            if call["function"]["arguments"]:
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
                )
        return out

    def finish(self, done: CompletionDone | None) -> list[SseEvent]:
        out = self._close()
        if self.texts == 0 and self.calls == 0:  # no text: one empty text block, as unstreamed
            out += self._begin("text", {"type": "text", "text": ""}) + self._close()
        reason, sequence = stop_reason(done, self.calls > 0)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        use = usage(done, self.prompt_tokens)
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": use}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _begin(self, kind: str, block: dict[str, Any]) -> list[SseEvent]:
        out = self._close()
        self.open = kind
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [*out, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> SseEvent:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta},
        )

    def _close(self) -> list[SseEvent]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]
