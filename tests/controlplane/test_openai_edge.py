"""The OpenAI edge without servers: which parameters are refused (and which are harmless),
and how a body that does not parse is described (message and `param`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.openai.errors import describe_validation_error, field_location
from pagedserve.controlplane.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.controlplane.openai.render import logit_bias_by_id

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 2}, "length_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
        # (tools are read by controlplane/src/pagedserve/controlplane/tools/definitions.py; an earlier call on a user message
        # or with a bad name is refused here)
        (
            {"messages": [{"role": "user", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a b"}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "assistant", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_unsupported_chat_parameters_are_refused_naming_them(extra: dict[str, Any], param: str) -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra})
    refused = body.unsupported()
    assert refused is not None and refused[0] == param
    assert refused[1].startswith(f"{param}: ")


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        {"response_format": {"type": "text"}},
        # structured outputs are read (and checked) by controlplane/src/pagedserve/controlplane/openai/structured.py
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": False}},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"user": "u", "store": False, "metadata": {"a": "b"}, "parallel_tool_calls": True},
        {"logit_bias": {"5": 10}},
        {"logprobs": True, "top_logprobs": 2},
    ],
)
def test_harmless_values_and_unknown_fields_pass(extra: dict[str, Any]) -> None:
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra}).unsupported() is None


def test_completions_refusals_and_defaults() -> None:
    body = CompletionRequest.model_validate({"prompt": "x"})
    assert body.model is None and body.num_choices == 1 and body.unsupported() is None
    assert CompletionRequest.model_validate({"prompt": "x", "n": None}).num_choices == 1
    assert (
        CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0}).unsupported() is None
    )
    assert (
        CompletionRequest.model_validate({"prompt": "x", "echo": True, "stream": True}).unsupported() is None
    )
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"suffix": "s"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ]
    for extra, param in cases:
        refused = CompletionRequest.model_validate({"prompt": "x", **extra}).unsupported()
        assert refused is not None and refused[0] == param


def errors_of(model: Any, data: Any) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(data)
    # FastAPI puts "body" first in each location.
    return [{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()]


def test_validation_errors_name_the_field_as_the_client_does() -> None:
    assert describe_validation_error(errors_of(ChatCompletionRequest, {"messages": [{"role": 1}]})) == (
        "messages[0].role: Input should be a valid string",
        "messages[0].role",
    )
    message, param = describe_validation_error(errors_of(CompletionRequest, {"prompt": [1, "a"]}))
    assert param == "prompt" and message.startswith("prompt: not any of the accepted forms")
    assert describe_validation_error(errors_of(CompletionRequest, {})) == ("prompt: Field required", "prompt")
    assert describe_validation_error(errors_of(CompletionRequest, [])) == (
        "the request body must be a JSON object",
        None,
    )


def test_a_json_decode_error_has_no_param_and_says_so() -> None:
    fastapi_error = {
        "type": "json_invalid",
        "loc": ("body", 0),
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": "Expecting value"},
    }
    assert describe_validation_error([fastapi_error]) == (
        "the request body is not valid JSON: Expecting value",
        None,
    )
    assert field_location(("prompt", "list[int]", 3)) == ("prompt", True)
    assert field_location(("messages", 2, "content")) == ("messages[2].content", False)


def test_logit_bias_keys_must_be_token_ids() -> None:
    assert logit_bias_by_id({"5": 1.5, " 7": -2}) == {5: 1.5, 7: -2}
    for key in ("abc", "-1", "1.5", "9" * 4400, ""):
        with pytest.raises(ServiceError) as err:
            logit_bias_by_id({key: 1.0})
        assert err.value.param == "logit_bias"
        assert len(err.value.message) < 100
