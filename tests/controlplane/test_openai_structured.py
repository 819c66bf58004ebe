"""Structured outputs over the OpenAI HTTP API, without servers: every form a client may send
(`response_format`, vLLM's `structured_outputs`, the `guided_*` aliases) read into the
expected Constraint, each refusal's status and the field it names, and the routes' wiring
(the constraint reaches the dispatcher; a data plane's refusal to compile it comes back
naming the client's field) over a fake dispatcher."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedserve.common.constraints import MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_SCHEMA_DEPTH, Constraint
from pagedserve.controlplane.edge.http_server import create_app
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.openai.protocol import UNSUPPORTED, ChatCompletionRequest
from pagedserve.controlplane.openai.render import MIN_LOGPROB, floored_logprob
from pagedserve.controlplane.openai.structured import Structured, structured_output
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dispatcher import Admitted, GenerationEvent
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def json_schema(schema: Any = SCHEMA, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **spec}}


def refusal(body: dict[str, Any]) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        structured_output(body)
    return err.value


# -- every accepted form ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "constraint", "field"),
    [
        (
            {"response_format": json_schema()},
            Constraint("json_schema", SCHEMA_TEXT),
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": json_schema(strict=True, description="one integer")},
            Constraint("json_schema", SCHEMA_TEXT),
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": json_schema(strict=None, description=None)},
            Constraint("json_schema", SCHEMA_TEXT),
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object"), "response_format"),
        (
            {"structured_outputs": {"json": SCHEMA}},
            Constraint("json_schema", SCHEMA_TEXT),
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},  # its JSON text
            Constraint("json_schema", SCHEMA_TEXT),
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"regex": "[0-9]{3}"}},
            Constraint("regex", "[0-9]{3}"),
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            Constraint("choice", choices=("yes", "no")),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            Constraint("grammar", 'root ::= "a" | "b"'),
            "structured_outputs.grammar",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            Constraint("json_object"),
            "structured_outputs.json_object",
        ),
        (  # unset members (null, json_object false) and the flags that change nothing here
            {
                "structured_outputs": {
                    "regex": "a+",
                    "json": None,
                    "json_object": False,
                    "disable_fallback": True,
                    "disable_any_whitespace": False,
                    "disable_additional_properties": True,
                    "whitespace_pattern": None,
                    "structural_tag": None,
                }
            },
            Constraint("regex", "a+"),
            "structured_outputs.regex",
        ),
        ({"guided_json": SCHEMA}, Constraint("json_schema", SCHEMA_TEXT), "guided_json"),
        ({"guided_json": SCHEMA_TEXT}, Constraint("json_schema", SCHEMA_TEXT), "guided_json"),
        ({"guided_regex": "a|b"}, Constraint("regex", "a|b"), "guided_regex"),
        ({"guided_choice": ["x"]}, Constraint("choice", choices=("x",)), "guided_choice"),
        ({"guided_grammar": 'root ::= "x"'}, Constraint("grammar", 'root ::= "x"'), "guided_grammar"),
        (  # text is no constraint: another source may be set beside it
            {"response_format": {"type": "text"}, "guided_regex": "a"},
            Constraint("regex", "a"),
            "guided_regex",
        ),
    ],
)
def test_each_form_is_read_into_its_constraint_named_where_the_client_put_it(
    body: dict[str, Any], constraint: Constraint, field: str
) -> None:
    assert structured_output(body) == Structured(constraint, {constraint.kind: field})


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"response_format": None},
        {"response_format": {"type": "text"}},
        {"structured_outputs": None, "guided_json": None, "guided_choice": None},
        {"guided_decoding_backend": "xgrammar", "user": "u"},  # unknown fields stay ignored
    ],
)
def test_no_constraint_when_none_is_asked_for(body: dict[str, Any]) -> None:
    assert structured_output(body) == Structured()


def test_key_order_is_kept_and_the_schema_is_compact() -> None:
    schema = {"properties": {"z": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    constraint = structured_output({"response_format": json_schema(schema)}).constraint
    assert constraint is not None
    assert constraint.value == '{"properties":{"z":{"type":"string"},"a":{"type":"integer"}},"type":"object"}'


def test_none_of_the_sources_is_refused_as_unsupported_any_longer() -> None:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"):
        assert name not in UNSUPPORTED
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "response_format": json_schema()}
    )
    assert body.unsupported() is None


def nest(depth: int) -> dict[str, Any]:
    """A schema `depth` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


# -- refusals: 400 naming the exact field ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": "json"},
            "response_format",
            "response_format must be a JSON object, got a string",
        ),
        ({"response_format": {}}, "response_format.type", "response_format.type must be set"),
        (
            {"response_format": {"type": "json"}},
            "response_format.type",
            "response_format.type must be one of text, json_object, json_schema, got 'json'",
        ),
        (
            {"response_format": {"type": "structural_tag"}},
            "response_format.type",
            "response_format.type must",
        ),
        ({"response_format": {"type": 3}}, "response_format.type", "response_format.type must be one of"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "response_format.json_schema must be set",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": []}},
            "response_format.json_schema",
            "response_format.json_schema must be a JSON object, got an array",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be set",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": 7, "schema": SCHEMA}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be set",
        ),
        (
            {"response_format": json_schema("{}")},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be a JSON object",
        ),
        (
            {"response_format": json_schema([SCHEMA])},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be a JSON object (a JSON Schema), got an array",
        ),
        (
            {"response_format": json_schema(strict="yes")},
            "response_format.json_schema.strict",
            "response_format.json_schema.strict must be a boolean, got a string",
        ),
        (
            {"response_format": json_schema(description=1)},
            "response_format.json_schema.description",
            "response_format.json_schema.description must be a string, got a number",
        ),
        (
            {"response_format": json_schema(nest(MAX_SCHEMA_DEPTH + 1))},
            "response_format.json_schema.schema",
            f"response_format.json_schema.schema must nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep",
        ),
        (
            {"response_format": json_schema({"enum": ["x" * MAX_CONSTRAINT_CHARS]})},
            "response_format.json_schema.schema",
            f"response_format.json_schema.schema must be at most {MAX_CONSTRAINT_CHARS} characters",
        ),
        (
            {"response_format": json_schema({"const": float("nan")})},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be JSON data",
        ),
        (
            {"response_format": json_schema({"title": "\ud800"})},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: not valid Unicode",
        ),
        (
            {"structured_outputs": []},
            "structured_outputs",
            "structured_outputs must be a JSON object, got an array",
        ),
        (
            {"structured_outputs": {}},
            "structured_outputs",
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, got none",
        ),
        (
            {"structured_outputs": {"json_object": False}},
            "structured_outputs",
            "structured_outputs must set exactly one of",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, got regex and choice",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "structured_outputs.whitespace_pattern: not supported by this server",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "structured_outputs.structural_tag: not supported by this server",
        ),
        (
            {"structured_outputs": {"regex": "a", "backend": "outlines"}},
            "structured_outputs.backend",
            "structured_outputs.backend: not a member of structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_fallback": "no"}},
            "structured_outputs.disable_fallback",
            "structured_outputs.disable_fallback must be a boolean, got a string",
        ),
        (
            {"structured_outputs": {"json_object": 1}},
            "structured_outputs.json_object",
            "structured_outputs.json_object must be true, got a number",
        ),
        (
            {"structured_outputs": {"json": 5}},
            "structured_outputs.json",
            "structured_outputs.json must be a JSON Schema (an object, or its JSON text), got a number",
        ),
        (
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "structured_outputs.json must be valid JSON",
        ),
        (
            {"structured_outputs": {"json": "[1]"}},
            "structured_outputs.json",
            "structured_outputs.json must be a JSON object",
        ),
        (
            {"structured_outputs": {"regex": ["a"]}},
            "structured_outputs.regex",
            "structured_outputs.regex must be a string (a regular expression), got an array",
        ),
        (
            {"structured_outputs": {"regex": ""}},
            "structured_outputs.regex",
            "structured_outputs.regex must not be empty",
        ),
        (
            {"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}},
            "structured_outputs.regex",
            f"structured_outputs.regex must be at most {MAX_CONSTRAINT_CHARS} characters",
        ),
        (
            {"structured_outputs": {"grammar": {"root": "x"}}},
            "structured_outputs.grammar",
            "structured_outputs.grammar must be a string",
        ),
        (
            {"structured_outputs": {"choice": "yes"}},
            "structured_outputs.choice",
            "structured_outputs.choice must be a list of strings, got a string",
        ),
        (
            {"structured_outputs": {"choice": ["yes", None]}},
            "structured_outputs.choice[1]",
            "structured_outputs.choice[1] must be a string, got null",
        ),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs.choice",
            f"structured_outputs.choice must list 1 to {MAX_CHOICES} strings, got 0",
        ),
        (
            {"structured_outputs": {"choice": ["a"] * (MAX_CHOICES + 1)}},
            "structured_outputs.choice",
            f"structured_outputs.choice must list 1 to {MAX_CHOICES} strings, got {MAX_CHOICES + 1}",
        ),
        (
            {"structured_outputs": {"choice": ["a", ""]}},
            "structured_outputs.choice",
            "structured_outputs.choice must list non-empty strings",
        ),
        (
            {"structured_outputs": {"choice": ["a", "\udc00"]}},
            "structured_outputs.choice[1]",
            "structured_outputs.choice[1]: not valid Unicode",
        ),
        ({"guided_json": [1]}, "guided_json", "guided_json must be a JSON Schema"),
        ({"guided_json": "[]"}, "guided_json", "guided_json must be a JSON object"),
        ({"guided_regex": 5}, "guided_regex", "guided_regex must be a string"),
        ({"guided_regex": "\ud800"}, "guided_regex", "guided_regex: not valid Unicode"),
        ({"guided_choice": [1]}, "guided_choice[0]", "guided_choice[0] must be a string, got a number"),
        ({"guided_grammar": ""}, "guided_grammar", "guided_grammar must not be empty"),
        # Two sources at once: the second is named.
        (
            {"response_format": json_schema(), "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "structured_outputs: a request may ask for one structured output only, and "
            "response_format already does",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
            "guided_json",
            "guided_json: a request may ask for one structured output only",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]},
            "guided_choice",
            "guided_choice: a request may ask for one structured output only, and structured_outputs already does",
        ),
        (
            {"guided_regex": "a", "guided_grammar": "root ::= x"},
            "guided_grammar",
            "guided_grammar: a request",
        ),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    error = refusal(body)
    assert (error.code, error.http_status, error.param) == ("INVALID_ARGUMENT", 400, param)
    assert error.message.startswith(message), error.message
    assert len(error.message) < 400


def test_a_long_unknown_member_name_is_clipped() -> None:
    error = refusal({"structured_outputs": {"regex": "a", "k" * 5000: 1}})
    assert error.param is not None and len(error.param) < 200 and len(error.message) < 400


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_is_still_not_implemented_is_refused(extra: dict[str, Any], param: str) -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    assert body.unsupported() == (param, f"{param}: not supported by this server")


# -- the routes' wiring, over a fake dispatcher -------------------------------------------------


class ScriptedDispatcher:
    """One token then a stop for every request, or the data plane's refusal `refuse`; records
    the requests it was given."""

    def __init__(self, refuse: ServiceError | None = None) -> None:
        info = SimpleNamespace(max_model_len=64, vocab_size=16, num_blocks=64, block_size=4)
        self.connections = {"dp:1": SimpleNamespace(info=info)}
        self.requests: list[GenerationRequest] = []
        self.refuse = refuse

    async def wait_for_startup(self, deadline: float | None = None) -> None:
        """A data plane has served (the start-up wait is tested in tests/e2e/scaling)."""

    async def generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        if self.refuse is not None:
            raise self.refuse
        yield Admitted("dp:1", 0.0, 0)
        rid = request.request_id
        yield dataplane_pb2.TokenDelta(request_id=rid, index=0, token_ids=[1])
        usage = common_pb2.Usage(prompt_tokens=request.num_prompt_tokens, completion_tokens=1)
        yield dataplane_pb2.RequestFinished(
            request_id=rid, index=0, finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage
        )


class DigitTokenizer:
    vocab_size = 16
    chat_template = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(t % 10) for t in token_ids)


def client(dispatcher: ScriptedDispatcher) -> TestClient:
    frontend = Frontend(dispatcher, DigitTokenizer(), "tiny", metrics=ControlPlaneMetrics())  # type: ignore[arg-type]
    return TestClient(create_app(frontend))


def post(dispatcher: ScriptedDispatcher, **body: Any) -> Any:
    return client(dispatcher).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, **body})


def test_the_constraint_reaches_the_dispatcher_named_as_the_client_put_it() -> None:
    dispatcher = ScriptedDispatcher()
    answer = post(dispatcher, structured_outputs={"regex": "[0-9]+"})
    assert answer.status_code == 200, answer.text
    (gen,) = dispatcher.requests
    assert gen.sampling_params.constraint == Constraint("regex", "[0-9]+")
    assert gen.constraint_field == "structured_outputs.regex"
    # Several prompts: each one carries it.
    assert post(dispatcher, prompt=[[1], [2]], response_format=json_schema()).status_code == 200
    assert [g.sampling_params.constraint for g in dispatcher.requests[1:]] == [
        Constraint("json_schema", SCHEMA_TEXT)
    ] * 2
    assert {g.constraint_field for g in dispatcher.requests[1:]} == {"response_format.json_schema.schema"}
    assert post(dispatcher, response_format={"type": "text"}).status_code == 200
    assert dispatcher.requests[-1].sampling_params.constraint is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_data_plane_cannot_compile_is_400_naming_the_clients_field(stream: bool) -> None:
    refused = ServiceError("INVALID_ARGUMENT", "json_schema could not be compiled: Cannot find field $defs")
    answer = post(
        ScriptedDispatcher(refused), stream=stream, response_format=json_schema({"$ref": "#/$defs/missing"})
    )
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "response_format.json_schema.schema could not be compiled: Cannot find field $defs",
        "type": "invalid_request_error",
        "param": "response_format.json_schema.schema",
        "code": "invalid_argument",
    }


def test_refusals_come_before_any_work_and_as_openai_errors() -> None:
    dispatcher = ScriptedDispatcher()
    answer = post(dispatcher, response_format=json_schema("not an object"))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"
    answer = post(dispatcher, guided_regex="a", ignore_eos=True)  # checked with the sampling fields
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "ignore_eos"
    assert dispatcher.requests == []


def test_a_masked_tokens_logprob_is_floored_for_json() -> None:
    assert floored_logprob(float("-inf")) == MIN_LOGPROB == -9999.0
    assert floored_logprob(-0.5) == -0.5
