"""The OpenAI HTTP edge against real servers (tiny model with a tokenizer): every bad input of
issue 12's "Found" list is a 400/404/405/413 in OpenAI's error JSON with `param` naming the
field, never a 500; the limits (body size, strings, n, context) hold; the vLLM extras
(`/v1/models/{id}`, `/tokenize`, `/detokenize`, `/version`) answer; nothing leaks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.common.version import __version__
from tests.e2e.hardening.tiny_served import Http, Reply, make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

CONTEXT = 256
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(model, num_blocks=64, max_model_len=CONTEXT), model)
    yield srv
    idle = srv.wait_idle()  # whatever was refused or served: every block is free again
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Http:
    return Http(server.http_url)


def completions(http: Http, **body: Any) -> Reply:
    return http.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})


def chat(http: Http, **body: Any) -> Reply:
    messages = [{"role": "user", "content": "Say hello."}]
    return http.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, **body})


def raw(http: Http, path: str, content: bytes | str) -> Reply:
    return http.post(path, content=content)


def error_of(response: Reply, status: int, param: str | None) -> dict[str, Any]:
    """The OpenAI error object of `response`, after checking its status, shape and param."""
    assert response.status == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return error


# -- integers the engine or the wire cannot hold: 400 naming the field, never 500 --------------


def test_max_tokens_minus_1_is_400_naming_max_tokens(http: Http) -> None:
    error = error_of(completions(http, max_tokens=-1), 400, "max_tokens")
    assert error["message"] == "max_tokens must be an integer >= 1, got -1"
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_argument")


def test_max_tokens_2_pow_32_is_400_naming_max_tokens(http: Http) -> None:
    error = error_of(completions(http, max_tokens=2**32), 400, "max_tokens")
    assert error["message"] == f"max_tokens must be at most {2**32 - 1}, got {2**32}"


@pytest.mark.parametrize("value", ["1e30", "-1e30"])
def test_max_tokens_plus_minus_1e30_is_400_naming_max_tokens(http: Http, value: str) -> None:
    response = raw(http, "/v1/completions", f'{{"prompt": [5, 6], "max_tokens": {value}}}')
    assert error_of(response, 400, "max_tokens")["message"].startswith("max_tokens")


def test_top_k_2_pow_31_is_400_naming_top_k(http: Http) -> None:
    error = error_of(completions(http, top_k=2**31), 400, "top_k")
    assert error["message"] == f"top_k must be at most {2**31 - 1}, got {2**31}"


@pytest.mark.parametrize(
    ("n", "message"),
    [(-1, "n must be an integer >= 1, got -1"), (2**40, f"n must be at most 128, got {2**40}")],
)
def test_n_minus_1_and_2_pow_40_are_400_naming_n(http: Http, n: int, message: str) -> None:
    assert error_of(completions(http, n=n), 400, "n")["message"] == message


@pytest.mark.parametrize("seed", [2**63, 2**64])
def test_seed_2_pow_63_and_2_pow_64_are_400_naming_seed(http: Http, seed: int) -> None:
    error = error_of(completions(http, seed=seed), 400, "seed")
    assert error["message"] == f"seed must be at most {2**63 - 1}, got {seed}"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([-1], "stop_token_ids must be non-negative integers, got (-1,)"),
        ([2**32], f"stop_token_ids must be at most {2**32 - 1}"),
        ([7] * 200_000, "stop_token_ids must hold at most 1024 token ids, got 200000"),
    ],
    ids=["minus-1", "2-pow-32", "too-many"],
)
def test_stop_token_ids_minus_1_and_2_pow_32_are_400_naming_stop_token_ids(
    http: Http, ids: list[int], message: str
) -> None:
    assert error_of(completions(http, stop_token_ids=ids), 400, "stop_token_ids")["message"] == message


def test_chat_max_completion_tokens_minus_1_is_400_naming_max_completion_tokens(http: Http) -> None:
    error = error_of(chat(http, max_completion_tokens=-1), 400, "max_completion_tokens")
    assert error["message"] == "max_completion_tokens must be an integer >= 1, got -1"


def test_chat_max_completion_tokens_0_names_max_completion_tokens(http: Http) -> None:
    error = error_of(chat(http, max_completion_tokens=0), 400, "max_completion_tokens")
    assert error["message"] == "max_completion_tokens must be an integer >= 1, got 0"


def test_a_duplicate_json_key_carrying_an_out_of_range_value_is_400(http: Http) -> None:
    response = raw(http, "/v1/completions", '{"prompt": [5], "max_tokens": 2, "max_tokens": 4294967296}')
    assert error_of(response, 400, "max_tokens")["message"] == (
        f"max_tokens must be at most {2**32 - 1}, got {2**32}"
    )


# -- strings ----------------------------------------------------------------------------------


def test_a_lone_surrogate_in_a_prompt_is_400_not_a_type_error(http: Http) -> None:
    response = raw(http, "/v1/completions", '{"prompt": "Say \\ud800.", "max_tokens": 2}')
    error = error_of(response, 400, "prompt")
    assert error["message"] == "prompt: not valid Unicode (a lone surrogate at character 4)"
    response = raw(
        http, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "Say \\ud800."}]}'
    )
    assert error_of(response, 400, "messages[0].content")["message"].endswith("at character 4)")


def test_a_10k_character_model_name_is_refused_and_not_echoed(http: Http) -> None:
    name = "m" * 10_000
    error = error_of(completions(http, model=name), 400, "model")
    assert error["message"] == "model: at most 256 characters"
    error = error_of(http.get(f"/v1/models/{name}"), 400, "model")
    assert len(error["message"]) < 100


def test_an_empty_model_is_refused_and_an_omitted_one_is_the_served_model(http: Http, model: Path) -> None:
    assert error_of(completions(http, model=""), 400, "model")["message"].startswith(
        "model must not be empty"
    )
    served = completions(http)  # no "model" at all
    assert served.status == 200, served.text
    assert served.json()["model"] == model.name  # a local folder is served under its name


def test_long_stop_strings_and_too_many_are_400_naming_stop(http: Http) -> None:
    assert error_of(completions(http, stop=["x" * 257]), 400, "stop[0]")["message"] == (
        "stop[0]: at most 256 characters"
    )
    error = error_of(completions(http, stop=["a"] * 17), 400, "stop")
    assert error["message"] == "stop: at most 16 non-empty strings"


def test_a_prompt_over_the_character_limit_is_400(http: Http) -> None:
    error = error_of(completions(http, prompt="x" * (2**20 + 1)), 400, "prompt")
    assert error["message"] == "prompt: at most 1048576 characters"


# -- bodies that do not parse, routes that do not exist ----------------------------------------


def test_invalid_json_is_400_in_the_openai_shape_without_param_0(http: Http) -> None:
    error = error_of(raw(http, "/v1/completions", '{"prompt": '), 400, None)
    assert error["message"] == "the request body is not valid JSON: Expecting value"
    assert "0:" not in error["message"]


def test_a_body_that_is_not_an_object_or_missing_a_field_is_400_with_param(http: Http) -> None:
    assert error_of(raw(http, "/v1/completions", "[]"), 400, None)["message"] == (
        "the request body must be a JSON object"
    )
    assert error_of(raw(http, "/v1/completions", "{}"), 400, "prompt")["message"] == "prompt: Field required"
    error = error_of(chat(http, messages=[{"role": 1}]), 400, "messages[0].role")
    assert error["message"] == "messages[0].role: Input should be a valid string"
    error = error_of(completions(http, max_tokens=1.5), 400, "max_tokens")
    assert "fractional part" in error["message"]


def test_the_message_naming_a_field_sets_param(http: Http) -> None:
    assert error_of(chat(http, temperature=-1.0), 400, "temperature")["message"] == (
        "temperature must be >= 0, got -1.0"
    )
    assert error_of(chat(http, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role")
    error = error_of(chat(http, model="gpt-4"), 404, "model")
    assert (error["type"], error["code"]) == ("not_found_error", "not_found")


def test_an_unknown_route_is_404_in_the_openai_shape(http: Http) -> None:
    error = error_of(http.get("/v1/nothing-here"), 404, None)
    assert error["message"] == "no such route: GET /v1/nothing-here"
    assert error["code"] == "not_found"


def test_a_wrong_method_is_405_in_the_openai_shape(http: Http) -> None:
    response = http.get("/v1/completions")
    error = error_of(response, 405, None)
    assert error["message"] == "method GET is not allowed on /v1/completions"
    assert response.headers["allow"] == "POST"


def test_a_20_mb_body_is_413_in_the_openai_shape(http: Http) -> None:
    # As a client sends it: the whole body with its length, then the answer is read.
    body = json.dumps({"prompt": "x" * (20 << 20), "max_tokens": 2})
    error = error_of(raw(http, "/v1/completions", body), 413, None)
    assert error == {
        "message": "the request body is larger than 4194304 bytes (4 MiB)",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused once 4 MiB have arrived
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * (1 << 20)
        yield b'"}'

    error_of(http.post("/v1/completions", content=chunked()), 413, None)
    # A declared length far beyond what is worth reading is refused before a byte is read.
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    answer = http.raw_exchange(head + b"content-length: 1000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"code":"request_too_large"' in answer
    assert completions(http).status == 200  # and the server goes on serving


# -- what used to run or be accepted silently ---------------------------------------------------


def test_max_tokens_beyond_the_context_is_400_as_vllm_answers(http: Http) -> None:
    error = error_of(completions(http, max_tokens=300), 400, "max_tokens")
    assert error["message"] == (
        f"max_tokens is too large: 300. This model's maximum context length is {CONTEXT} tokens "
        f"and your request has 3 input tokens (300 > {CONTEXT} - 3)"
    )
    error = error_of(chat(http, max_completion_tokens=2**31), 400, "max_completion_tokens")
    assert error["message"].startswith("max_completion_tokens is too large: 2147483648.")


def test_top_p_1e_minus_9_is_not_rounded_to_0_and_refused(http: Http) -> None:
    response = completions(http, top_p=1e-9, max_tokens=3, ignore_eos=True)
    assert response.status == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(http: Http, extra: dict[str, Any], param: str) -> None:
    error = error_of(chat(http, **extra), 400, param)
    assert error["message"].startswith(f"{param}: not supported by this server")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),  # auto with no tools declared
        ({"tool_choice": True}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(http: Http, extra: dict[str, Any], param: str) -> None:
    error = error_of(chat(http, **extra), 400, param)
    assert error["message"].startswith(param)


def test_n_above_the_maximum_is_400_before_any_work(http: Http) -> None:
    assert error_of(chat(http, n=129), 400, "n")["message"] == "n must be at most 128, got 129"
    error = error_of(completions(http, prompt=[[5, 6]] * 9, n=128), 400, "n")
    assert error["message"].startswith("n: 9 prompts × n=128 asks for 1152 completions")


# -- structured outputs: a bad one is 400 naming the field where the client put it --------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be set",
        ),
        (
            {"response_format": json_schema("{}")},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be a JSON object",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type must be one of"),
        ({"structured_outputs": {}}, "structured_outputs", "structured_outputs must set exactly one of"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "structured_outputs.whitespace_pattern: not supported by this server",
        ),
        (
            {"response_format": json_schema(SCHEMA), "guided_regex": "a"},
            "guided_regex",
            "guided_regex: a request may ask for one structured output only",
        ),
        ({"guided_choice": ["a", 2]}, "guided_choice[1]", "guided_choice[1] must be a string"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ],
)
def test_bad_structured_outputs_are_400_naming_the_field(
    http: Http, extra: dict[str, Any], param: str, message: str
) -> None:
    for reply in (chat(http, **extra), completions(http, **extra)):
        assert error_of(reply, 400, param)["message"].startswith(message)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": json_schema({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}, "structured_outputs.json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ],
)
def test_what_the_data_plane_cannot_compile_is_400_naming_the_clients_field(
    http: Http, extra: dict[str, Any], param: str
) -> None:
    for stream in (False, True):  # refused before the stream starts: a status, not an event
        error = error_of(chat(http, stream=stream, **extra), 400, param)
        assert error["message"].startswith(f"{param} could not be compiled: "), error
    assert chat(http).status == 200  # and the server serves on


def test_structured_outputs_hold_even_on_random_weights(http: Http) -> None:
    reply = completions(http, max_tokens=16, structured_outputs={"choice": ["yes", "no"]})
    assert reply.status == 200, reply.text
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) in (("yes", "stop"), ("no", "stop"))
    reply = chat(http, max_tokens=16, guided_regex="[0-9]{3}")
    assert reply.status == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] in {f"{i:03d}" for i in range(1000)}


# -- vLLM's extra routes --------------------------------------------------------------------------


def test_models_by_id(http: Http, model: Path) -> None:
    card = http.get(f"/v1/models/{model.name}")
    assert card.status == 200
    assert http.get(f"/v1/models/{model}").json() == card.json()  # the path: its name's card
    assert card.json() == {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "pagedserve",
        "max_model_len": CONTEXT,
    }
    error = error_of(http.get("/v1/models/gpt-4"), 404, "model")
    assert error["message"].startswith("model: 'gpt-4' is not served here")


def test_tokenize_detokenize_and_version(http: Http, server: ServerThread) -> None:
    tokens = http.post("/tokenize", {"prompt": "Say hello."}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == CONTEXT
    assert http.post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Say hello."}
    chat_tokens = http.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    without = http.post(
        "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    ).json()
    assert chat_tokens["count"] > without["count"] > 0
    # The prompt a completion is generated from is exactly what /tokenize reports.
    usage = completions(http, prompt="Say hello.").json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    assert http.get("/version").json() == {"version": __version__}
    error_of(http.post("/tokenize", {"prompt": "a", "messages": []}), 400, "prompt")
    error_of(http.post("/detokenize", {"tokens": [10**6]}), 400, "tokens")
    error_of(raw(http, "/tokenize", '{"prompt": "Say \\ud800"}'), 400, "prompt")


def test_logprobs_of_masked_tokens_are_minus_9999_not_an_invalid_json_infinity(http: Http) -> None:
    """Found by the fuzzer: top logprobs under a grammar list masked tokens at -inf, which JSON
    cannot carry (a 500; a stream sent `-Infinity`). They are floored at -9999.0, as vLLM does."""
    constrained = {"guided_choice": ["0"], "max_tokens": 3}
    for stream in (False, True):
        reply = chat(http, logprobs=True, top_logprobs=3, stream=stream, **constrained)
        assert reply.status == 200, reply.text
        assert "Infinity" not in reply.text and "NaN" not in reply.text
        reply = completions(http, logprobs=3, stream=stream, **constrained)
        assert reply.status == 200, reply.text
        assert "Infinity" not in reply.text and "NaN" not in reply.text
    content = chat(http, logprobs=True, top_logprobs=3, **constrained).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert content[0]["token"] == "0"  # (then the end-of-sequence token the grammar leaves)
    assert -9999.0 in [top["logprob"] for top in content[0]["top_logprobs"]]
