"""Structured outputs in a GenerateRequest: the constraint keywords of `build_request`, read
into the wire's `SamplingParams.constraint` oneof (at most one)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pagedserve.protos.pagedserve.v1 import common_pb2


class SchemaModel(Protocol):
    """A class with pydantic's (v2) `model_json_schema()`: any `pydantic.BaseModel` subclass."""

    @classmethod
    def model_json_schema(cls) -> dict[str, Any]: ...


JsonSchema = str | Mapping[str, Any] | type[SchemaModel]
"""A JSON Schema: its JSON text, the parsed document, or a pydantic model class."""

CONSTRAINT_ARGUMENTS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""The keyword arguments that constrain the output, named as the wire's `SamplingParams` oneof."""


def json_schema_text(schema: JsonSchema) -> str:
    """A JSON schema as the JSON text the wire carries: a string is sent as it is (the server
    checks it), a mapping is dumped, a pydantic model class gives its `model_json_schema()`.
    Raises TypeError for anything else (and json.dumps' errors for a mapping that is not JSON data)."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, type):
        method = getattr(schema, "model_json_schema", None)
        if method is None:
            raise TypeError(
                f"json_schema: the class {schema.__name__} has no model_json_schema() (a pydantic model has)"
            )
        schema = method()
    if not isinstance(schema, Mapping):
        raise TypeError(
            "json_schema must be a dict, its JSON text or a pydantic model class, "
            f"got {type(schema).__name__}"
        )
    return json.dumps(dict(schema), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def set_constraint(
    params: common_pb2.SamplingParams,
    *,
    json_schema: JsonSchema | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> None:
    """Set the `constraint` oneof of `params` from at most one of the arguments (None, and
    `json_object=False`, mean "not given"); two or more raise ValueError naming them. The
    server validates the values (sizes, a compilable schema) and names the field when it refuses
    one ("sampling_params.json_schema ...")."""
    given = {
        "json_schema": json_schema is not None,
        "json_object": bool(json_object),
        "regex": regex is not None,
        "choice": choice is not None,
        "grammar": grammar is not None,
    }
    names = [name for name in CONSTRAINT_ARGUMENTS if given[name]]
    if len(names) > 1:
        listed = ", ".join(names[:-1]) + " and " + names[-1]
        raise ValueError(f"{listed} given: at most one constraint per request")
    if json_schema is not None:
        params.json_schema = json_schema_text(json_schema)
    elif json_object:
        params.json_object = True
    elif regex is not None:
        params.regex = regex
    elif choice is not None:
        if isinstance(choice, str):
            raise TypeError("choice must be a sequence of strings, got one string")
        params.choice.choices.extend(choice)
        if not choice:  # an empty list still selects the kind (the server refuses it, naming it)
            params.choice.SetInParent()
    elif grammar is not None:
        params.grammar = grammar
