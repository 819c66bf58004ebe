"""Reading a completion's tool calls, whichever protocol asked: which parser, which finish."""

from __future__ import annotations

from pagedserve.controlplane.tools.definitions import ToolUse
from pagedserve.controlplane.tools.forced import FORCED_NAMED, FORCED_REQUIRED
from pagedserve.controlplane.tools.parsers import ToolCallParser, default_call_id, make_parser


def open_parser(use: ToolUse, model_format: str) -> ToolCallParser:
    """The parser of one completion of a request that lets the model call tools: the forced
    JSON for "required" and a named function, the model family's format for "auto"."""
    fmt = {"required": FORCED_REQUIRED, "function": FORCED_NAMED}.get(use.choice.mode, model_format)
    return make_parser(
        fmt,
        default_call_id,
        tool_names=[t.name for t in use.tools],
        forced_name=use.choice.name or None,
    )


def finish_reason(reason: str, has_calls: bool) -> str:
    """The finish reason of an answer of a request with tools: "tool_calls" for one that
    holds a call and was not cut short by max_tokens (`reason` is "stop" or "length")."""
    if reason != "stop":
        return reason
    return "tool_calls" if has_calls else "stop"


class CompletionParsers:
    """One parser per completion index of a request (made on the index's first text)."""

    def __init__(self, use: ToolUse, model_format: str) -> None:
        self._use = use
        self._format = model_format
        self._parsers: dict[int, ToolCallParser] = {}

    def __call__(self, index: int) -> ToolCallParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = open_parser(self._use, self._format)
        return parser
