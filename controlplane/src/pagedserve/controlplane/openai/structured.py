"""Structured outputs over HTTP: where a client may ask for one, read into one `Constraint`.

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  or `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs` extra: an object setting exactly one of `json` (a schema, or its
  JSON text), `regex`, `choice` (strings), `grammar` (EBNF with a `root` rule), `json_object`
  (true);
- vLLM's older top-level aliases `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` (deprecated there, kept here so older clients work).

A request sets at most one of these. Every refusal is INVALID_ARGUMENT (HTTP 400) naming the
field as the client wrote it ("response_format.json_schema.schema must be a JSON object ...");
`Structured.field_names` maps the constraint's kind to that same name, so that what
`Frontend.validate` and the data plane (a schema that cannot be compiled) refuse later is
named the same way. Nothing is compiled here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.constraints import Constraint, normalize_json_schema
from pagedserve.common.invalid_field import InvalidField
from pagedserve.controlplane.errors import ServiceError, clip, invalid_argument, json_type

SOURCES = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
"""The top-level fields that can carry a constraint, in the order a conflict is reported (the
second one set is named)."""
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The members of vLLM's `structured_outputs` that each are a constraint."""
STRUCTURED_FLAGS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
"""vLLM's flags that change nothing here: there is one backend (no fallback), JSON is always
generated without free whitespace and schemas are held strictly (no properties beyond those
listed), which is what the flags ask for when true and allowed output when false."""
STRUCTURED_REFUSED = ("whitespace_pattern", "structural_tag")
"""vLLM's members that would change the output and that this server does not implement."""
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Structured:
    """The request's constraint (None: free text) and where the client put it: the
    constraint's kind -> the client's field name, for `Frontend.validate(field_names=...)`."""

    constraint: Constraint | None = None
    field_names: Mapping[str, str] = field(default_factory=dict)


NONE = Structured()


def structured_output(body: Mapping[str, Any]) -> Structured:
    """The constraint a request body asks for (its top-level fields; unset ones are absent or
    null); raises INVALID_ARGUMENT naming the field."""
    sources = [name for name in SOURCES if _sets_constraint(name, body.get(name))]
    if not sources:
        return NONE
    if len(sources) > 1:
        first, second = sources[0], sources[1]
        raise invalid_argument(
            f"{second}: a request may ask for one structured output only, and {first} already does",
            second,
        )
    name = sources[0]
    return _PARSERS[name](body[name])


def _sets_constraint(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":  # {"type": "text"} is plain text
        return not (isinstance(value, dict) and value.get("type") == "text")
    return True


# -- the sources -----------------------------------------------------------------------------------


def _response_format(value: Any) -> Structured:
    if not isinstance(value, dict):
        raise _must("response_format", f"be a JSON object, got {json_type(value)}")
    kind = value.get("type")
    if kind is None:
        raise _must("response_format.type", f"be set: one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_TYPES:
        got = repr(clip(kind, 32)) if isinstance(kind, str) else json_type(kind)
        raise _must("response_format.type", f"be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {got}")
    if kind == "json_object":
        return _built("response_format", "json_object")
    spec = value.get("json_schema")
    if spec is None:
        raise _must("response_format.json_schema", "be set when response_format.type is json_schema")
    if not isinstance(spec, dict):
        raise _must("response_format.json_schema", f"be a JSON object, got {json_type(spec)}")
    name = spec.get("name")
    if name is None:
        raise _must("response_format.json_schema.name", "be set")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        got = repr(clip(name, 32)) if isinstance(name, str) else json_type(name)
        raise _must(
            "response_format.json_schema.name",
            f"be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {got}",
        )
    for key, kinds, label in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise _must(f"response_format.json_schema.{key}", f"be {label}, got {json_type(spec[key])}")
    schema = spec.get("schema")
    where = "response_format.json_schema.schema"
    if schema is None:
        raise _must(where, "be set: the JSON Schema the output must match")
    if not isinstance(schema, dict):
        raise _must(where, f"be a JSON object (a JSON Schema), got {json_type(schema)}")
    return _built(where, "json_schema", _schema(schema, where))


def _structured_outputs(value: Any) -> Structured:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise _must(where, f"be a JSON object, got {json_type(value)}")
    for key, member in value.items():
        name = f"{where}.{clip(key, 64)}"
        if key in STRUCTURED_KINDS:
            continue
        if key in STRUCTURED_FLAGS:
            if member is not None and not isinstance(member, bool):
                raise _must(name, f"be a boolean, got {json_type(member)}")
        elif key in STRUCTURED_REFUSED:
            if member is not None:
                raise invalid_argument(f"{name}: not supported by this server", name)
        else:
            raise invalid_argument(
                f"{name}: not a member of structured_outputs (one of {', '.join(STRUCTURED_KINDS)} "
                f"and the flags {', '.join(STRUCTURED_FLAGS)})",
                name,
            )
    flag = value.get("json_object")
    if flag is not None and not isinstance(flag, bool):
        raise _must(f"{where}.json_object", f"be true, got {json_type(flag)}")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        got = " and ".join(kinds) if kinds else "none"
        raise _must(where, f"set exactly one of {', '.join(STRUCTURED_KINDS)}, got {got}")
    kind = kinds[0]
    member = value[kind]
    name = f"{where}.{kind}"
    if kind == "json":
        return _json(member, name)
    if kind == "regex":
        return _regex(member, name)
    if kind == "choice":
        return _choice(member, name)
    if kind == "grammar":
        return _grammar(member, name)
    return _built(name, "json_object")


def _json(value: Any, where: str) -> Structured:
    if not isinstance(value, dict | str):
        raise _must(where, f"be a JSON Schema (an object, or its JSON text), got {json_type(value)}")
    return _built(where, "json_schema", _schema(value, where))


def _regex(value: Any, where: str) -> Structured:
    if not isinstance(value, str):
        raise _must(where, f"be a string (a regular expression), got {json_type(value)}")
    return _built(where, "regex", value)


def _grammar(value: Any, where: str) -> Structured:
    if not isinstance(value, str):
        raise _must(where, f"be a string (an EBNF grammar with a root rule), got {json_type(value)}")
    return _built(where, "grammar", value)


def _choice(value: Any, where: str) -> Structured:
    if not isinstance(value, list):
        raise _must(where, f"be a list of strings, got {json_type(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise _must(f"{where}[{i}]", f"be a string, got {json_type(item)}")
    return _built(where, "choice", choices=tuple(value))


_PARSERS: dict[str, Callable[[Any], Structured]] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: _json(v, "guided_json"),
    "guided_regex": lambda v: _regex(v, "guided_regex"),
    "guided_choice": lambda v: _choice(v, "guided_choice"),
    "guided_grammar": lambda v: _grammar(v, "guided_grammar"),
}


# -- helpers ---------------------------------------------------------------------------------------


def _schema(schema: dict[str, Any] | str, where: str) -> str:
    try:
        return normalize_json_schema(schema, where)
    except InvalidField as exc:
        raise _must_reason(exc.field, exc.reason) from None


def _built(where: str, kind: str, value: str = "", choices: tuple[str, ...] = ()) -> Structured:
    """The constraint, its limits checked (named `where`), its text valid Unicode (JSON can
    carry a lone surrogate; protobuf and the grammar backend cannot)."""
    try:
        constraint = Constraint(kind, value, choices)
    except InvalidField as exc:
        raise _must_reason(where, exc.reason) from None
    for i, text in enumerate((constraint.value, *constraint.choices)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            name = where if kind != "choice" else f"{where}[{i - 1}]"
            raise invalid_argument(
                f"{name}: not valid Unicode (a lone surrogate at character {exc.start})", name
            ) from None
    return Structured(constraint, {kind: where})


def _must(where: str, what: str) -> ServiceError:
    return invalid_argument(f"{where} must {what}", where)


def _must_reason(where: str, reason: str) -> ServiceError:
    return invalid_argument(f"{where} {clip(reason, 200)}", where)
