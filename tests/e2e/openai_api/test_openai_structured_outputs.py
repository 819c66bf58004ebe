"""Structured outputs through the official `openai` client against a real server (real default
model): every greedy output under 46 JSON schemas (nested objects, enums, arrays with
minItems/maxItems, $defs/$ref, anyOf, nullable types, string patterns, non-ASCII keys,
integer ranges, booleans, const, ...) validates with `jsonschema`, and so do sampled ones;
`json_object`, `client.beta.chat.completions.parse` with a pydantic model, vLLM's
`structured_outputs` (choice, regex, grammar) and `guided_*` aliases; a schema the data plane
cannot compile is a 400 naming `response_format.json_schema.schema`; a stream is the greedy
answer, delta by delta. The schemas run concurrently (the server batches them)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jsonschema
import openai
import pydantic
import pytest

from pagedserve.common.models import DEFAULT_MODEL
from tests.e2e.harness import ServerThread, engine_config

pytestmark = pytest.mark.real_model

T = TypeVar("T")
MAX_TOKENS = 200  # every schema here is answered in well under this (greedy: at most ~60)


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """An object schema; every property required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        **kw,
    }


STR = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 10_000}

# (name, task, schema): the name is OpenAI's json_schema.name; the task is the user's message.
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "person",
        "Describe a person.",
        obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    ("city", "Describe a city.", obj({"city": STR, "country": STR, "population": INT})),
    ("bool_flag", "Is the sky blue?", obj({"answer": {"type": "boolean"}})),
    ("enum_color", "Pick a color.", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("enum_int", "Pick a rating.", obj({"stars": {"enum": [1, 2, 3, 4, 5]}})),
    ("const", "Say the version.", obj({"version": {"const": "v1"}, "ok": {"type": "boolean"}})),
    (
        "nested",
        "Describe a book and its author.",
        obj(
            {
                "title": STR,
                "author": obj({"name": STR, "born": {"type": "integer", "minimum": 1000, "maximum": 2025}}),
            }
        ),
    ),
    (
        "deep_nested",
        "Describe a company address.",
        obj(
            {
                "company": obj(
                    {
                        "name": STR,
                        "address": obj({"street": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                    }
                )
            }
        ),
    ),
    (
        "array_ints",
        "List three numbers.",
        obj({"numbers": {"type": "array", "items": INT, "minItems": 3, "maxItems": 3}}),
    ),
    (
        "array_strs",
        "List some fruits.",
        obj({"fruits": {"type": "array", "items": STR, "minItems": 1, "maxItems": 4}}),
    ),
    (
        "array_objects",
        "List two people.",
        obj(
            {
                "people": {
                    "type": "array",
                    "items": obj({"name": STR, "age": INT}),
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "top_array",
        "List colors.",
        {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    ),
    ("top_string", "Name a planet.", {"type": "string", "maxLength": 20}),
    ("top_integer", "Pick a number from 1 to 10.", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("top_boolean", "Is water wet?", {"type": "boolean"}),
    ("top_enum", "Yes or no?", {"enum": ["yes", "no"]}),
    (
        "nullable_string",
        "Give a nickname, or null.",
        obj({"nickname": {"type": ["string", "null"], "maxLength": 16}}),
    ),
    (
        "nullable_int",
        "Give an age, or null.",
        obj({"age": {"type": ["integer", "null"], "minimum": 0, "maximum": 150}}),
    ),
    ("anyof_scalar", "Give an id.", obj({"id": {"anyOf": [INT, {"type": "string", "maxLength": 12}]}})),
    (
        "anyof_objects",
        "Give a shape.",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "radius": INT}),
                        obj({"kind": {"const": "square"}, "side": INT}),
                    ]
                }
            }
        ),
    ),
    (
        "defs_ref",
        "Describe two addresses.",
        {
            "$defs": {"addr": obj({"street": STR, "city": STR})},
            **obj({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}}),
        },
    ),
    (
        "defs_ref_array",
        "List items.",
        {
            "$defs": {
                "item": obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                )
            },
            **obj(
                {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}}
            ),
        },
    ),
    (
        "defs_chain",
        "Describe an order.",
        {
            "$defs": {
                "money": obj({"cents": INT, "currency": {"enum": ["EUR", "USD"]}}),
                "line": obj({"what": STR, "price": {"$ref": "#/$defs/money"}}),
            },
            **obj({"line": {"$ref": "#/$defs/line"}}),
        },
    ),
    (
        "pattern_code",
        "Give a flight code.",
        obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    ),
    (
        "pattern_date",
        "Give a date.",
        obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    ),
    (
        "email_pattern",
        "Give an email.",
        obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    ),
    (
        "non_ascii_keys",
        "Décris une personne.",
        obj({"名前": STR, "âge": {"type": "integer", "minimum": 0, "maximum": 150}}),
    ),
    (
        "non_ascii_enum",
        "Choisis une saison.",
        obj({"saison": {"enum": ["été", "hiver", "printemps", "automne"]}}),
    ),
    (
        "int_range_negative",
        "Give a temperature.",
        obj({"celsius": {"type": "integer", "minimum": -40, "maximum": 50}}),
    ),
    ("int_range_wide", "Give a year.", obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}})),
    ("int_exact", "Count to one.", obj({"n": {"type": "integer", "minimum": 1, "maximum": 1}})),
    ("unbounded_int", "How many legs has a spider?", obj({"legs": {"type": "integer"}})),
    ("number", "Give a price.", obj({"price": {"type": "number"}})),
    (
        "optional_props",
        "Describe a pet.",
        obj({"name": STR, "species": {"enum": ["cat", "dog"]}, "age": INT}, required=["name"]),
    ),
    ("no_required", "Describe a car.", obj({"make": STR, "year": INT}, required=[])),
    (
        "mixed_types",
        "Describe a product.",
        obj(
            {
                "name": STR,
                "price": {"type": "number"},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": STR, "maxItems": 2},
            }
        ),
    ),
    (
        "bool_array",
        "Three true/false answers.",
        obj({"answers": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}}),
    ),
    (
        "nested_arrays",
        "A 2x2 matrix.",
        obj(
            {
                "matrix": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "empty_object",
        "Return an empty object.",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
    (
        "closed_object",
        "Describe a dog.",
        obj({"name": STR, "good": {"type": "boolean"}}, additionalProperties=False),
    ),
    (
        "title_desc",
        "Describe a movie.",
        obj(
            {
                "title": {"type": "string", "maxLength": 30, "description": "the title"},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            },
            title="Movie",
            description="a film",
        ),
    ),
    ("enum_mixed", "Pick a value.", obj({"v": {"enum": ["a", 1, True, None]}})),
    ("const_fields", "Status report.", obj({"status": {"const": "ok"}, "code": {"const": 200}})),
    (
        "anyof_null",
        "Maybe a score.",
        obj({"score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]}}),
    ),
    (
        "nullable_object",
        "Optional manager.",
        obj({"manager": {"type": ["object", "null"], "properties": {"name": STR}, "required": ["name"]}}),
    ),
    (
        "string_enum_array",
        "Pick weekdays.",
        obj(
            {
                "days": {
                    "type": "array",
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "minItems": 2,
                    "maxItems": 3,
                }
            }
        ),
    ),
]
# Sampled too (temperature 0.8, a seed, n=2): schemas whose every value is bounded in length.
SAMPLED = (
    "person",
    "bool_flag",
    "enum_color",
    "const",
    "nested",
    "array_ints",
    "array_objects",
    "nullable_string",
    "anyof_objects",
    "defs_ref_array",
    "pattern_date",
    "non_ascii_keys",
    "nested_arrays",
    "string_enum_array",
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(DEFAULT_MODEL, num_blocks=512, max_model_len=2048), DEFAULT_MODEL)
    yield srv
    srv.close()


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(task: str) -> Any:  # (Any: the client types its messages as TypedDicts)
    return [{"role": "user", "content": f"{task} Answer in JSON."}]


def response_format(name: str, schema: dict[str, Any]) -> Any:  # (Any: a TypedDict)
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def concurrently(work: Callable[[T], Any], items: list[T]) -> list[Any]:
    with ThreadPoolExecutor(16) as pool:  # the engine's max_num_seqs: one batch at a time
        return list(pool.map(work, items))


def problems(name: str, schema: dict[str, Any], choice: Any) -> list[str]:
    """What is wrong with one answer (empty: it finished and matches its schema)."""
    text = choice.message.content
    if choice.finish_reason != "stop":
        return [
            f"{name}: finish_reason {choice.finish_reason} (schema too large for {MAX_TOKENS} tokens?): {text!r}"
        ]
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return [f"{name}: {str(exc).splitlines()[0]}: {text!r}"]
    return []


def test_the_schemas_are_valid_and_enough() -> None:
    assert len(SCHEMAS) >= 40 and len({name for name, _, _ in SCHEMAS}) == len(SCHEMAS)
    for _, _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    assert set(SAMPLED) <= {name for name, _, _ in SCHEMAS}


def test_every_greedy_answer_matches_its_schema(client: openai.OpenAI, server: ServerThread) -> None:
    def run(item: tuple[str, str, dict[str, Any]]) -> list[str]:
        name, task, schema = item
        out = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=ask(task),
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=response_format(name, schema),
        )
        return problems(name, schema, out.choices[0])

    failures = [p for found in concurrently(run, SCHEMAS) for p in found]
    assert failures == [], f"{len(failures)} of {len(SCHEMAS)} schemas failed:\n" + "\n".join(failures)
    server.wait_idle()


def test_sampled_answers_match_their_schemas(client: openai.OpenAI) -> None:
    chosen = [item for item in SCHEMAS if item[0] in SAMPLED]

    def run(item: tuple[str, str, dict[str, Any]]) -> list[str]:
        name, task, schema = item
        out = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=ask(task),
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=1234,
            n=2,
            response_format=response_format(name, schema),
        )
        assert len(out.choices) == 2
        return [p for choice in out.choices for p in problems(name, schema, choice)]

    failures = [p for found in concurrently(run, chosen) for p in found]
    assert failures == [], "\n".join(failures)


def test_json_object_answers_are_json_objects(client: openai.OpenAI) -> None:
    tasks = ['Return {"ok": true} as JSON.', "Give a JSON object with a name and an age."]

    def run(task: str) -> Any:
        return client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": task}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format={"type": "json_object"},
        ).choices[0]

    for choice in concurrently(run, tasks):
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=24)


def test_the_clients_parse_helper_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    out = client.beta.chat.completions.parse(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content or "")


def test_structured_outputs_choice_regex_grammar_and_the_guided_aliases(client: openai.OpenAI) -> None:
    cities = ["Paris", "London", "Berlin"]
    cases: list[tuple[dict[str, Any], Callable[[str], bool]]] = [
        ({"structured_outputs": {"choice": cities}}, lambda text: text in cities),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        (
            {"structured_outputs": {"regex": "[A-Z][a-z]{2,9}, [0-9]{4}"}},
            lambda text: re.fullmatch("[A-Z][a-z]{2,9}, [0-9]{4}", text) is not None,
        ),
        ({"guided_regex": "[0-9]{2}"}, lambda text: re.fullmatch("[0-9]{2}", text) is not None),
        (
            {"structured_outputs": {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}},
            lambda text: text in ("The answer is yes.", "The answer is no."),
        ),
        (
            {"guided_json": {"type": "integer", "minimum": 1, "maximum": 5}},
            lambda text: json.loads(text) in range(1, 6),
        ),
        ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
    ]

    def run(case: tuple[dict[str, Any], Callable[[str], bool]]) -> str | None:
        extra, holds = case
        choice = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=60,
            temperature=0,
            extra_body=extra,
        ).choices[0]
        text = choice.message.content or ""
        return (
            None
            if choice.finish_reason == "stop" and holds(text)
            else f"{extra}: {choice.finish_reason} {text!r}"
        )

    assert [f for f in concurrently(run, cases) if f] == []
    # The completions route takes them too.
    out = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="The year the Berlin wall fell:",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"regex": " [0-9]{4}"}},
    )
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch(" [0-9]{4}", out.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": response_format("s", {"$ref": "#/$defs/missing"})},
            "response_format.json_schema.schema",
        ),
        (
            {"extra_body": {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}},
            "structured_outputs.json",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ],
)
def test_what_cannot_be_compiled_is_a_bad_request_naming_the_field(
    client: openai.OpenAI, server: ServerThread, extra: dict[str, Any], param: str
) -> None:
    for stream in (False, True):  # refused before a stream starts: a status the client raises
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=10,
                stream=stream,
                **extra,
            )
        assert err.value.status_code == 400
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert body["message"].startswith(f"{param} could not be compiled: "), body
    # The server serves on, a normal request and the same kind of constraint, valid.
    ok = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert ok.choices[0].message.content
    server.wait_idle()


def test_a_bad_schema_is_refused_at_the_edge_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format=response_format("s", "{}"),  # type: ignore[arg-type]
        )
    assert isinstance(err.value.body, dict)
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert err.value.body["message"].startswith("response_format.json_schema.schema must be a JSON object")


def test_a_stream_is_the_greedy_answer_delta_by_delta(client: openai.OpenAI) -> None:
    name, task, schema = next(item for item in SCHEMAS if item[0] == "nested")
    kwargs: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "messages": ask(task),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "response_format": response_format(name, schema),
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == whole.message.content
    assert reasons[-1] == whole.finish_reason == "stop"
    assert len([p for p in pieces if p]) > 1  # streamed, not one piece
    jsonschema.validate(json.loads("".join(pieces)), schema)
