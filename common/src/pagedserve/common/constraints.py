"""What a request's output must match (structured outputs), validated at construction.
Imports no torch and no grammar backend: both planes and the wire use it.

A `Constraint` is one of vLLM's structured-output kinds (its `StructuredOutputsParams`):

- `json_schema`: the output is a JSON value valid under this JSON Schema (`value`, JSON text);
- `json_object`: the output is any JSON object (OpenAI's `{"type": "json_object"}`);
- `regex`: the output matches this regular expression (`value`);
- `choice`: the output is exactly one of `choices`;
- `grammar`: the output is a sentence of this EBNF grammar (`value`, in the GBNF dialect the
  backend reads, with a `root` rule).

Everything a client controls is bounded here, before anything is compiled: the text's size,
the schema's nesting depth, the number and size of choices. Whether a schema or grammar can be
compiled is decided by the data plane's grammar backend, under a time limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.common.invalid_field import InvalidField

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The kinds, named as the wire's `SamplingParams` oneof and vLLM's structured outputs name them."""
MAX_CONSTRAINT_CHARS = 64 * 1024
"""The most characters a schema, regex or grammar (or all choices together) may have."""
MAX_SCHEMA_DEPTH = 32
"""The deepest nesting of objects and arrays a JSON schema document may have."""
MAX_CHOICES = 256
"""The most alternatives a `choice` constraint may list."""


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON document (iterative: a client's document cannot exhaust
    the stack here)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node)
    return deepest


def _nesting_upper_bound(text: str) -> int:
    """The deepest bracket nesting of a JSON text, found before parsing it (json.loads recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def normalize_json_schema(schema: object, name: str = "json_schema") -> str:
    """A JSON schema (a dict, or its JSON text) as compact JSON text, so equal schemas share one
    compiled grammar; raises InvalidField naming `name`. Key order is kept: it is the order
    the properties are generated in."""
    if isinstance(schema, str):
        if len(schema) > MAX_CONSTRAINT_CHARS:
            raise InvalidField(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(schema)}")
        if _nesting_upper_bound(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidField(name, f"must nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep")
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidField(name, f"must be valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidField(name, f"must be a JSON object (a JSON Schema), got {type(schema).__name__}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidField(name, f"must nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidField(name, f"must be JSON data: {exc}") from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidField(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
    return text


@dataclass(frozen=True)
class Constraint:
    """One structured-output constraint. Invalid values raise `InvalidField` naming the kind
    (e.g. "regex must be at most 65536 characters ..."); the HTTP front end names its own field.
    A json_schema's `value` is kept as compact JSON text."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidField(
                "constraint", f"must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.value, str):
            raise InvalidField(self.kind, f"must be a string, got {type(self.value).__name__}")
        if self.kind == "json_schema":
            object.__setattr__(self, "value", normalize_json_schema(self.value, self.kind))
        elif self.kind in ("regex", "grammar"):
            if not self.value:
                raise InvalidField(self.kind, "must not be empty")
            if len(self.value) > MAX_CONSTRAINT_CHARS:
                raise InvalidField(
                    self.kind, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.value)}"
                )
        elif self.value:
            raise InvalidField(self.kind, "takes no value")
        if not isinstance(self.choices, list | tuple):
            raise InvalidField("choice", f"must be a list of strings, got {type(self.choices).__name__}")
        choices = tuple(self.choices)
        if self.kind == "choice":
            if not choices or len(choices) > MAX_CHOICES:
                raise InvalidField("choice", f"must list 1 to {MAX_CHOICES} strings, got {len(choices)}")
            if any(not isinstance(c, str) or not c for c in choices):
                raise InvalidField("choice", "must list non-empty strings")
            if sum(len(c) for c in choices) > MAX_CONSTRAINT_CHARS:
                raise InvalidField("choice", f"must total at most {MAX_CONSTRAINT_CHARS} characters")
        elif choices:
            raise InvalidField(self.kind, "takes no choices")
        object.__setattr__(self, "choices", choices)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (with the tokenizer): equal keys share one."""
        return (self.kind, self.value, self.choices)

    def describe(self) -> str:
        """A short label for logs (never the whole schema)."""
        size = len(self.value) + sum(len(c) for c in self.choices)
        return f"{self.kind}({size} chars)"
