"""The Responses API's answers: the response object, and its stream of events.

Output items: a `reasoning` item (one `reasoning_text` part) when a reasoning parser found
a reasoning section, a `message` item (one `output_text` part) when the answer has text or no
call, then one `function_call` item per call; text and calls come out of the chat path's tool-call
parser, so a streamed answer's items assemble to the unstreamed answer's. `status` is
"completed", or "incomplete" (`incomplete_details.reason` "max_output_tokens") when the answer
was cut short. Every streamed event carries a `sequence_number`, from 0.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.controlplane.frontend import CompletionDone
from pagedserve.controlplane.openai.running import SseEvent


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(done: CompletionDone | None, prompt_tokens: int) -> dict[str, Any]:
    prompt = done.prompt_tokens if done is not None else prompt_tokens
    completion = done.completion_tokens if done is not None else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": done.cached_tokens if done is not None else 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chat message (`reasoning_content`, `content`, `tool_calls`) as output items."""
    calls = message.get("tool_calls") or []
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or ""))
    for call in calls:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message a later request continuing them repeats."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


@dataclass
class ResponseObject:
    """The parts of a response object that do not depend on what was generated."""

    id: str
    model: str
    echo: dict[str, Any]  # the request's settings, as the response reports them
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": use,
            **self.echo,
        }


def final_status(done: CompletionDone | None) -> str:
    return "incomplete" if done is None or done.finish_reason == "length" else "completed"


class ResponseStream:
    """The events of one streamed response, from the chat path's deltas (`content` and
    `tool_calls` as a chat chunk has them). One item is open at a time: the message, or the
    latest call (a parser emits a call's arguments before the next call begins)."""

    def __init__(self, response: ResponseObject, prompt_tokens: int) -> None:
        self.response, self.prompt_tokens = response, prompt_tokens
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output so far; the last one may be open
        self.open = False

    def start(self) -> list[SseEvent]:
        body = self.response.body("in_progress", [], None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, delta: dict[str, Any]) -> list[SseEvent]:
        out: list[SseEvent] = []
        if delta.get("reasoning_content"):
            if not (self.open and self.items[-1]["type"] == "reasoning"):
                out += self._open(reasoning_item(new_id("rs"), "", "in_progress"))
            self.items[-1]["content"][0]["text"] += delta["reasoning_content"]
            out.append(
                self._item_event(
                    "response.reasoning_text.delta", content_index=0, delta=delta["reasoning_content"]
                )
            )
        if delta.get("content"):
            if not (self.open and self.items[-1]["type"] == "message"):
                out += self._open_message()
            self.items[-1]["content"][0]["text"] += delta["content"]
            out.append(
                self._item_event(
                    "response.output_text.delta", content_index=0, delta=delta["content"], logprobs=[]
                )
            )
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                out += self._open(
                    call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
                )
            if call["function"]["arguments"]:
                self.items[-1]["arguments"] += call["function"]["arguments"]
                out.append(
                    self._item_event(
                        "response.function_call_arguments.delta", delta=call["function"]["arguments"]
                    )
                )
        return out

    def finish(self, done: CompletionDone | None) -> tuple[list[SseEvent], dict[str, Any]]:
        """The closing events, and the response object they end with."""
        out = self._close()
        if not any(i["type"] != "reasoning" for i in self.items):  # no text: an empty message, as unstreamed
            out += self._open_message() + self._close()
        status = final_status(done)
        body = self.response.body(status, self.items, usage(done, self.prompt_tokens))
        out.append(self._event(f"response.{status}", response=body))
        return out, body

    def _open_message(self) -> list[SseEvent]:
        out = self._open(message_item(new_id("msg"), "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items[-1]["content"].append(part)
        return [*out, self._item_event("response.content_part.added", content_index=0, part=dict(part))]

    def _open(self, item: dict[str, Any]) -> list[SseEvent]:
        out = self._close()
        self.items.append(item)
        self.open = True
        return [
            *out,
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)),
        ]

    def _close(self) -> list[SseEvent]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = "completed"
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._item_event("response.reasoning_text.done", content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._item_event("response.output_text.done", content_index=0, text=part["text"], logprobs=[])
            )
            out.append(self._item_event("response.content_part.done", content_index=0, part=part))
        else:
            args = item["arguments"]
            out.append(
                self._item_event("response.function_call_arguments.done", arguments=args, name=item["name"])
            )
        out.append(self._event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        return out

    def _item_event(self, kind: str, **data: Any) -> SseEvent:
        return self._event(kind, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, **data)

    def _event(self, kind: str, **data: Any) -> SseEvent:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return (kind, event)
