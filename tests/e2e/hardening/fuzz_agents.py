"""What the fuzz suite (test_fuzz.py) sends to the APIs agents speak, and how it judges the
answers: Anthropic's `/v1/messages` and OpenAI's `/v1/responses`.

Bodies mix valid requests (at most 4 tokens, short texts: they fit the tiny model's 256-token
context, so no tools in a valid body: their prompt would not) with valid requests made hostile
in one to three fields (wrong types, huge or negative numbers, lone surrogates, junk content
blocks and input items, unknown fields, duplicate keys, a dropped required field). Every
answer: never a 5xx, within CASE_TIMEOUT_S, an error in the API's own shape (Anthropic's for
/v1/messages, OpenAI's for /v1/responses) with a bounded message, a valid request answered
200, a stream that ends with its closing event.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.e2e.hardening import fuzz_cases as fc

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
_TEXT = fc.SHORT_TEXT
_TOOL = {"name": "f", "input_schema": {"type": "object"}}
_BLOCK_TYPES = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document", ""])
_ITEM_TYPES = st.sampled_from(
    ["message", "function_call", "function_call_output", "reasoning", "item_reference"]
)


def _anthropic_valid() -> dict[str, st.SearchStrategy[Any]]:
    user = st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": _TEXT
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), min_size=1, max_size=2
            ),
        }
    )
    turns = st.lists(user, min_size=1, max_size=1) | st.tuples(
        user, st.fixed_dictionaries({"role": st.just("assistant"), "content": _TEXT}), user
    ).map(list)
    return {"model": st.just(fc.MODEL_PLACEHOLDER), "max_tokens": st.integers(1, 4), "messages": turns}


_ANTHROPIC_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "system": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2),
    "stop_sequences": st.lists(_TEXT.map(lambda s: s[:6]), max_size=3),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 50),
    "stream": st.booleans(),
    "metadata": st.fixed_dictionaries({"user_id": _TEXT}),
}
_ANTHROPIC_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system", ""]) | fc.HOSTILE,
                "content": fc.HOSTILE
                | st.lists(
                    st.fixed_dictionaries(
                        {"type": _BLOCK_TYPES | fc.HOSTILE},
                        optional={
                            "text": fc.HOSTILE,
                            "id": fc.HOSTILE,
                            "name": fc.HOSTILE,
                            "input": fc.HOSTILE,
                            "tool_use_id": fc.HOSTILE,
                            "content": fc.HOSTILE,
                            "is_error": fc.HOSTILE,
                        },
                    ),
                    max_size=3,
                ),
            }
        ),
        max_size=3,
    )
    | fc.HOSTILE,
    "tools": st.lists(st.just(_TOOL) | fc.JUNK, max_size=2) | fc.HOSTILE,
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"]) | fc.HOSTILE},
        optional={"name": fc.HOSTILE, "disable_parallel_tool_use": fc.HOSTILE},
    )
    | fc.HOSTILE,
    "system": fc.HOSTILE | st.lists(fc.JUNK, max_size=2),
    "stop_sequences": fc.FIELD_HOSTILE["stop"],
    "max_tokens": fc.INTS,
    "thinking": fc.JUNK,
    "output_config": fc.JUNK | st.fixed_dictionaries({"format": fc.JUNK}),
}


def _responses_valid() -> dict[str, st.SearchStrategy[Any]]:
    item = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "developer", "system"]),
            "content": _TEXT
            | st.lists(
                st.fixed_dictionaries({"type": st.just("input_text"), "text": _TEXT}), min_size=1, max_size=2
            ),
        }
    )
    return {
        "model": st.just(fc.MODEL_PLACEHOLDER),
        "max_output_tokens": st.integers(1, 4),
        "input": _TEXT
        | st.lists(item, min_size=1, max_size=2).map(
            lambda items: [*items, {"role": "user", "content": "hi"}]
        ),
    }


_RESPONSES_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "instructions": _TEXT,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
    "text": st.just({"format": {"type": "text"}}),
}
_RESPONSES_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "input": st.lists(
        st.fixed_dictionaries(
            {"type": _ITEM_TYPES | fc.HOSTILE},
            optional={
                "role": fc.HOSTILE,
                "content": fc.HOSTILE
                | st.lists(st.fixed_dictionaries({"type": fc.STRINGS, "text": fc.HOSTILE}), max_size=2),
                "call_id": fc.HOSTILE,
                "name": fc.HOSTILE,
                "arguments": fc.HOSTILE,
                "output": fc.HOSTILE,
            },
        ),
        max_size=3,
    )
    | fc.HOSTILE,
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function") | fc.HOSTILE, "name": fc.HOSTILE}, optional={"parameters": fc.JUNK}
        ),
        max_size=2,
    )
    | fc.HOSTILE,
    "tool_choice": fc.HOSTILE | st.fixed_dictionaries({"type": fc.STRINGS, "name": fc.HOSTILE}),
    "text": fc.JUNK
    | st.fixed_dictionaries(
        {
            "format": fc.STRUCTURED_HOSTILE["response_format"]
            | st.fixed_dictionaries({"type": st.just("json_schema"), "name": fc.STRINGS, "schema": fc.JUNK})
        }
    ),
    "previous_response_id": fc.STRINGS | st.just("resp_" + "0" * 32),
    "max_output_tokens": fc.INTS,
    "instructions": fc.HOSTILE,
    "metadata": fc.JUNK,
    "store": fc.HOSTILE,
    "background": fc.JUNK,
}


@st.composite
def agents_case(draw: st.DrawFn, route: str, model: str) -> fc.HttpCase:
    """A body for `route` (valid, then 0-3 mutations), with its key as a Bearer header or (on
    /v1/messages) Anthropic's x-api-key header."""
    anthropic = route == MESSAGES
    required = _anthropic_valid() if anthropic else _responses_valid()
    optional = _ANTHROPIC_OPTIONAL if anthropic else _RESPONSES_OPTIONAL
    hostile = _ANTHROPIC_HOSTILE if anthropic else _RESPONSES_HOSTILE
    body = fc.Body(route, list(draw(st.fixed_dictionaries(required, optional=optional)).items()), valid=True)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["hostile", "hostile", "hostile", "drop", "unknown", "duplicate"]))
        name = draw(st.sampled_from(sorted({*hostile, *(k for k, _ in body.pairs)})))
        value = draw(hostile[name]) if name in hostile and draw(st.booleans()) else draw(fc.HOSTILE)
        if kind == "drop":
            body.pairs = [(k, v) for k, v in body.pairs if k != name]
        elif kind == "unknown":
            body.pairs.append((draw(fc.STRINGS), draw(fc.JUNK)))
        elif kind == "duplicate":
            body.pairs.append((name, value))
        else:
            body.pairs = [(k, v) for k, v in body.pairs if k != name] + [(name, value)]
        body.valid = False
        body.mutations.append(f"{kind}:{name}")
    key = [("x-api-key", fc.KEY)] if anthropic and draw(st.booleans()) else []
    headers = fc.headers_with("application/json", [] if key else [f"Bearer {fc.KEY}"], key)
    abandon = draw(st.sampled_from(["", "", "", "before", "during"])) if body.valid and body.streams else ""
    return fc.HttpCase(
        "POST", route, headers, body.render(model), body.valid, abandon, ",".join(body.mutations)
    )


def check_agents_http(case: fc.HttpCase, answer: fc.Answer | None) -> None:
    """What every answer of /v1/messages and /v1/responses must be."""
    if answer is None:
        return
    anthropic = case.path == MESSAGES
    where = f"{case.path} {case.note} body={case.body[:300] if case.body else None!r}"
    assert answer.status < 500, f"{answer.status} for {where}: {answer.content[:500]!r}"
    assert answer.seconds < fc.CASE_TIMEOUT_S, f"{answer.seconds:.1f} s for {where}"
    if answer.partial:
        return
    content_type = answer.headers.get("content-type", "")
    if answer.status >= 400:
        assert content_type == "application/json", f"{content_type} for {where}"
        body = json.loads(answer.content)
        if anthropic:
            assert set(body) == {"type", "error"} and body["type"] == "error", f"{body} for {where}"
            assert set(body["error"]) == {"type", "message"}, where
            assert body["error"]["type"] != "api_error", where
        else:
            assert set(body) == {"error"} and body["error"]["type"] != "server_error", f"{body} for {where}"
        message = body["error"]["message"]
        assert isinstance(message, str) and 0 < len(message) <= fc.MAX_MESSAGE_CHARS, where
        assert not case.valid, f"a valid request was refused: {body} for {where}"
        return
    if case.valid:
        assert answer.status == 200, f"{answer.status} for a valid request: {where}"
    if content_type.startswith("text/event-stream"):
        names = [line[7:] for line in answer.content.decode().split("\n") if line.startswith("event: ")]
        closing = ("message_stop",) if anthropic else ("response.completed", "response.incomplete")
        assert names and (names[-1] in closing or names[-1] == "error"), f"stream ended {names[-3:]}: {where}"
        assert not (case.valid and names[-1] == "error"), f"a valid request failed in its stream: {where}"
    else:
        json.loads(answer.content)
