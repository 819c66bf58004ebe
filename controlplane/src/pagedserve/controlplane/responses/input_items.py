"""`GET /v1/responses/{id}/input_items`: the input items a stored response was created from.

A response's items are its own request's `input` (not the conversation it continued, nor its
instructions), as OpenAI lists them: a string input is one user message; each message's text
content is a list of `input_text` parts (`output_text` for an assistant's); every item gets
an `id` when it was sent without one (`msg_…`, `fc_…`, `fco_…`, `rs_…`). They are kept with the
response in the store (store.py), so they count toward its bounds and go when it goes.
The listing is OpenAI's cursor page: `order` (`desc`, newest first, by default; or `asc`),
`limit` (1 … 100, default 20) and `after` (an item id: the items after it in that order).
"""

from __future__ import annotations

from typing import Any

from pagedserve.controlplane.errors import clip, invalid_argument
from pagedserve.controlplane.responses.render import new_id

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """A request's `input` as items (once `translate` has validated it)."""
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for sent in items:
        item = {"type": sent.get("type", "message"), **sent}
        if item["type"] == "message":
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = new_id(_ID_PREFIX.get(item["type"], "item"))
        out.append(item)
    return out


def page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page of the items, as OpenAI's list object; raises INVALID_ARGUMENT naming the bad
    query parameter."""
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid_argument(f"limit: must be in [1, {MAX_LIMIT}], got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise invalid_argument(f"order: must be asc or desc, got {clip(order, 32)!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_argument(f"after: no input item {clip(after, 64)!r} in this response", "after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
