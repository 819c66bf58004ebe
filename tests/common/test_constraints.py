"""Structured-output constraints: validation at construction (bounded, named by kind) and the
wire round trip of every kind."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.constraints import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    MAX_SCHEMA_DEPTH,
    Constraint,
    normalize_json_schema,
)
from pagedserve.common.protocol import sampling_params_from_proto, sampling_params_to_proto
from pagedserve.common.sampling_params import InvalidField, SamplingParams
from pagedserve.protos.pagedserve.v1 import common_pb2

SCHEMA = {"type": "object", "properties": {"ключ": {"type": "string"}, "a": {"type": "integer"}}}


def test_a_schema_is_kept_compact_in_its_own_key_order() -> None:
    spaced = json.dumps(SCHEMA, indent=4, ensure_ascii=True)
    c = Constraint("json_schema", spaced)
    assert c.value == '{"type":"object","properties":{"ключ":{"type":"string"},"a":{"type":"integer"}}}'
    assert Constraint("json_schema", json.dumps(SCHEMA)).key == c.key
    assert normalize_json_schema(SCHEMA) == c.value


@pytest.mark.parametrize(
    ("kind", "value", "choices", "field", "reason"),
    [
        ("xml", "", (), "constraint", "must be one of"),
        ("json_schema", "[1, 2]", (), "json_schema", "must be a JSON object"),
        ("json_schema", "{", (), "json_schema", "must be valid JSON"),
        (
            "json_schema",
            "[" * (MAX_SCHEMA_DEPTH + 1) + "]" * (MAX_SCHEMA_DEPTH + 1),
            (),
            "json_schema",
            "deep",
        ),
        ("json_schema", json.dumps({"d": "x" * MAX_CONSTRAINT_CHARS}), (), "json_schema", "at most"),
        ("regex", "", (), "regex", "must not be empty"),
        ("grammar", "x" * (MAX_CONSTRAINT_CHARS + 1), (), "grammar", "at most"),
        ("json_object", "{}", (), "json_object", "takes no value"),
        ("choice", "", (), "choice", "1 to"),
        ("choice", "", tuple(str(i) for i in range(MAX_CHOICES + 1)), "choice", "1 to"),
        ("choice", "", ("a", ""), "choice", "non-empty"),
        ("regex", "a", ("a",), "regex", "takes no choices"),
    ],
)
def test_bad_constraints_are_named(
    kind: str, value: str, choices: tuple[str, ...], field: str, reason: str
) -> None:
    with pytest.raises(InvalidField) as err:
        Constraint(kind, value, choices)
    assert err.value.field == field
    assert reason in err.value.reason


def test_a_deep_schema_is_refused_before_it_is_parsed() -> None:
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000  # json.loads would recurse past the stack limit
    with pytest.raises(InvalidField, match="deep"):
        Constraint("json_schema", deep[: MAX_CONSTRAINT_CHARS - 10] + "}")


def test_ignore_eos_cannot_be_combined_with_a_constraint() -> None:
    with pytest.raises(InvalidField) as err:
        SamplingParams(ignore_eos=True, constraint=Constraint("json_object"))
    assert err.value.field == "ignore_eos"


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", json.dumps(SCHEMA)),
        Constraint("json_object"),
        Constraint("regex", r"\d{3}"),
        Constraint("choice", choices=("yes", "no", "¿quizás?")),
        Constraint("grammar", 'root ::= "a" | "b"'),
    ],
)
def test_every_kind_crosses_the_wire(constraint: Constraint) -> None:
    params = SamplingParams(max_tokens=9, constraint=constraint)
    msg = sampling_params_to_proto(params)
    assert msg.WhichOneof("constraint") == constraint.kind
    assert sampling_params_from_proto(msg) == params


def test_the_wire_names_a_bad_constraint_by_its_field() -> None:
    msg = common_pb2.SamplingParams(max_tokens=4, json_object=False)
    with pytest.raises(InvalidField) as err:
        sampling_params_from_proto(msg)
    assert err.value.field == "json_object"
    msg = common_pb2.SamplingParams(max_tokens=4, json_schema="not json")
    with pytest.raises(InvalidField) as err:
        sampling_params_from_proto(msg)
    assert err.value.field == "json_schema"
    assert sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=4)).constraint is None
