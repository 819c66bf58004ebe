"""Structured outputs from the Python client (docs/api.md, "Structured outputs over gRPC").

Against a real server on the default model: a greedy request with a small JSON schema (given
as a dict, as JSON text and as a pydantic model, sync and asyncio) ends with STOP and its text
parses and validates under the schema; a `choice` request answers one of the choices; a schema
the server cannot compile fails with INVALID_ARGUMENT naming `sampling_params.json_schema`.
Without a server: each keyword sets its member of the wire's `constraint` oneof, and two raise
ValueError naming both. (The Go and Java examples' `--json-schema` and `--choice` are checked in
test_go_java_clients.py.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pydantic
import pytest

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient, build_request
from tests.e2e.harness import ServerThread, engine_config

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PERSON_PROMPT = [
    {"role": "user", "content": "Give me a JSON object describing a person, with a name and an age."}
]


class Person(pydantic.BaseModel):
    name: str
    age: int


# -- the request, without a server ----------------------------------------------------------------


def test_each_keyword_sets_its_member_of_the_oneof() -> None:
    def params(**kw: Any) -> Any:
        return build_request("x", **kw).sampling_params

    assert params().WhichOneof("constraint") is None
    assert params(json_object=False).WhichOneof("constraint") is None
    as_dict = params(json_schema=PERSON_SCHEMA)
    assert as_dict.WhichOneof("constraint") == "json_schema"
    assert json.loads(as_dict.json_schema) == PERSON_SCHEMA
    assert list(json.loads(as_dict.json_schema)["properties"]) == ["name", "age"]  # order kept
    assert params(json_schema='{"type": "object"}').json_schema == '{"type": "object"}'  # as given
    from_model = json.loads(params(json_schema=Person).json_schema)
    assert from_model == Person.model_json_schema()
    assert params(json_object=True).json_object is True
    assert params(regex="[0-9]+").regex == "[0-9]+"
    assert list(params(choice=("yes", "no")).choice.choices) == ["yes", "no"]
    assert params(choice=[]).WhichOneof("constraint") == "choice"  # the server refuses it, naming it
    assert params(grammar='root ::= "a"').grammar == 'root ::= "a"'


def test_two_constraints_raise_naming_both() -> None:
    with pytest.raises(ValueError, match=r"^json_schema and choice given: at most one constraint"):
        build_request("x", json_schema=PERSON_SCHEMA, choice=["a"])
    with pytest.raises(ValueError, match=r"^json_object, regex and grammar given"):
        build_request("x", json_object=True, regex="a", grammar='root ::= "a"')


def test_a_json_schema_must_be_a_schema_or_a_model() -> None:
    with pytest.raises(TypeError, match="json_schema must be a dict, its JSON text or a pydantic model"):
        build_request("x", json_schema=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has no model_json_schema"):
        build_request("x", json_schema=int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one string"):
        build_request("x", choice="yes")


# -- against a real server on the default model ---------------------------------------------------


@pytest.fixture(scope="module")
def server(default_model_path: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(default_model_path), default_model_path)
    yield srv
    srv.close()


@pytest.mark.real_model
def test_a_json_schema_gives_valid_json_that_stops(server: ServerThread) -> None:
    schemas: dict[str, Any] = {"dict": PERSON_SCHEMA, "text": json.dumps(PERSON_SCHEMA), "pydantic": Person}
    with GenerationClient(server.grpc_address, timeout=120) as client:
        for how, schema in schemas.items():
            (out,) = client.generate(PERSON_PROMPT, max_tokens=64, temperature=0.0, json_schema=schema)
            assert out.finish_reason == "stop", (how, out.text)
            value = json.loads(out.text)
            jsonschema.validate(value, PERSON_SCHEMA)
            if how == "pydantic":
                Person.model_validate(value)

    async def streamed() -> tuple[str, str]:
        async with AsyncGenerationClient(server.grpc_address, timeout=120) as client:
            (out,) = await client.generate(
                PERSON_PROMPT, max_tokens=64, temperature=0.0, json_schema=PERSON_SCHEMA
            )
            return out.text, out.finish_reason

    text, finish = asyncio.run(streamed())
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    server.wait_idle()


@pytest.mark.real_model
def test_a_choice_answers_one_of_the_choices(server: ServerThread) -> None:
    choices = ["yes", "no", "maybe"]
    with GenerationClient(server.grpc_address, timeout=120) as client:
        for prompt in ("Is the sky blue? Answer:", [{"role": "user", "content": "Is fire cold?"}]):
            (out,) = client.generate(prompt, max_tokens=16, temperature=0.0, choice=choices)
            assert out.text in choices, (prompt, out.text)
            assert out.finish_reason == "stop"


@pytest.mark.real_model
def test_an_uncompilable_schema_is_invalid_argument_naming_the_field(server: ServerThread) -> None:
    with GenerationClient(server.grpc_address, timeout=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", max_tokens=8, json_schema={"$ref": "#/$defs/missing"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("sampling_params.json_schema"), err.value.details()
        # the server goes on serving: the same client, a good schema
        (out,) = client.generate(PERSON_PROMPT, max_tokens=64, temperature=0.0, json_schema=Person)
        assert out.finish_reason == "stop"
    server.wait_idle()
