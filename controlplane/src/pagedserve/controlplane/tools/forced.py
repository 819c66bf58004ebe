"""The grammar that forces a tool call: `tool_choice` "required" or a named function.

A forced answer is not written in the model family's own call format: the structured-output
machinery constrains the whole output to JSON, as vLLM does for these choices, so every call
parses and its arguments validate against the tool's schema.

- a named function: the output is that function's arguments (its parameters schema);
- "required": the output is a JSON array of `{"name": <one tool's name>, "arguments": <that
  tool's parameters>}` objects, at least one, and exactly one when `parallel_tool_calls` is
  false, else at most the server's `--max-tool-calls` (the grammar enforces it: no call is
  ever dropped afterwards).

The "required" schema nests every tool's parameters under one root, so each tool's schema
moves into the root's `$defs` (as `tool<i>`, its own `$defs` as `tool<i>_<name>`) and its
local `$ref`s are rewritten to point there (the grammar backend resolves `#/$defs/...`
pointers, not pointers through array indices).
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.common.constraints import Constraint
from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.tools.definitions import ToolUse

FORCED_REQUIRED = "forced_required"
FORCED_NAMED = "forced_named"
"""The parser formats (pagedserve.controlplane.tools.parsers) of the two forced outputs."""


def forced_constraint(use: ToolUse) -> tuple[Constraint, str] | None:
    """The constraint a forced tool choice puts on the output and the client field it comes
    from (a compile refusal is reported there); None when the choice forces nothing."""
    if use.choice.mode == "function":
        tool_index = next(i for i, t in enumerate(use.tools) if t.name == use.choice.name)
        where = f"tools[{tool_index}].function.parameters"
        return _constraint(use.tool(use.choice.name).parameters, where), where
    if use.choice.mode == "required":
        return _constraint(json.dumps(required_schema(use), ensure_ascii=False), "tools"), "tools"
    return None


def required_schema(use: ToolUse) -> dict[str, Any]:
    """The JSON Schema of a "required" answer: an array of calls of the declared tools."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(use.tools):
        prefix = f"tool{i}"
        schema = json.loads(tool.parameters)
        own_defs = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
        defs[prefix] = _rewrite_refs(schema, prefix)
        for name, sub in own_defs.items():
            defs[f"{prefix}_{name}"] = _rewrite_refs(sub, prefix)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": {"$ref": f"#/$defs/{prefix}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    # At most `use.max_calls` calls (one without parallel calls): unbounded, a model that keeps
    # calling would run until its context is full.
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    array["maxItems"] = use.bounded_calls
    if defs:
        array["$defs"] = defs
    return array


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """`node` with its local `$ref`s pointed into the root's `$defs` (iterative over the
    document: a client's schema is bounded in depth, but no recursion is needed)."""
    root: list[Any] = [node]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        value = parent[key]
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str):
                value["$ref"] = _moved(ref, prefix)
            stack.extend((value, k) for k in value if k != "$ref" or not isinstance(ref, str))
        elif isinstance(value, list):
            stack.extend((value, i) for i in range(len(value)))
    return root[0]


def _moved(ref: str, prefix: str) -> str:
    if ref == "#":
        return f"#/$defs/{prefix}"
    for section in ("#/$defs/", "#/definitions/"):
        if ref.startswith(section):
            return f"#/$defs/{prefix}_{ref[len(section) :]}"
    if ref.startswith("#/"):
        return f"#/$defs/{prefix}/{ref[2:]}"
    return ref  # not local: the grammar backend refuses it, named `tools`


def _constraint(schema: str, where: str) -> Constraint:
    try:
        return Constraint("json_schema", schema)
    except InvalidField as exc:
        raise InvalidField(where, exc.reason) from None
