"""What the fuzz suite (test_fuzz.py) sends and how it judges each answer.

Strategies (hypothesis) for OpenAI JSON bodies, routes, query strings and headers, and for
gRPC messages (typed, and raw wire bytes that no typed client could send), each mixing
valid requests, valid requests with one to three fields made hostile, and junk; a bare HTTP
client that sends exactly the bytes and headers a case means (duplicate headers included);
and the checks every answer must pass: never 5xx / UNKNOWN / INTERNAL, never slower than
CASE_TIMEOUT_S, errors in their documented shape with a bounded message, streams that end.

Valid generation requests ask for at most 4 tokens (a rare one leaves max_tokens unset: the
rest of a 256-token context), so hundreds of cases run in seconds on a tiny model.
"""

from __future__ import annotations

import http.client
import json
import math
import struct
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import strategies as st

from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2

CASE_TIMEOUT_S = 10.0
"""Every case is answered within this (a slower answer, or none, fails as a hang)."""
MAX_MESSAGE_CHARS = 1024
"""An error message never grows with what the client sent (values are clipped, not echoed)."""
KEY = "alpha"
AUTH = ("authorization", f"Bearer {KEY}")
VOCAB = 384  # pagedserve.benchmarks.tiny_models.VOCAB: ids below it are valid prompt tokens
SERVICE = "/pagedserve.v1.GenerationService"
GRPC_METHODS = ("Generate", "Tokenize", "Detokenize", "ListModels")
# What a GenerationService call may end with; anything else (UNKNOWN, INTERNAL, a deadline:
# a hang, UNAVAILABLE: a plane fell over) fails the case.
GRPC_ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,  # a method the service does not have
    }
)


# -- values -------------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
ANY_CHAR = st.characters(codec="utf-8") | SURROGATES  # (codec="utf-8" alone has no surrogates)
VALID_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40)
# A prompt or message of at most 12 characters: at most 48 tokens of the byte-level BPE, so any
# valid request (2 messages of 2 parts, 3 prompts) fits the 256-token context.
SHORT_TEXT = VALID_TEXT.map(lambda s: s[:12])
HOSTILE_TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=40),
    st.just(""),
    st.builds(
        lambda c, n: c * n, st.sampled_from(["x", "é", "☃", "\x00", "\ud800"]), st.sampled_from([257, 10_000])
    ),
    st.sampled_from(["Say \ud800.", "\udfff", "#", "a#b", "\x00", "\u202e", "\ufeff", "𝔘𝔫𝔦"]),
)
STRINGS = VALID_TEXT | HOSTILE_TEXT
EDGE_INTS = st.sampled_from(
    [
        -(2**64),
        -(2**63) - 1,
        -(2**63),
        -(2**32),
        -(2**31) - 1,
        -(2**31),
        -(10**30),
        -1,
        0,
        1,
        2,
        3,
        20,
        21,
        127,
        128,
        129,
        255,
        256,
        300,
        301,
        1024,
        2**31 - 1,
        2**31,
        2**32 - 1,
        2**32,
        2**40,
        2**63 - 1,
        2**63,
        2**64,
        10**30,
        10**4000,
    ]
)
INTS = EDGE_INTS | st.integers()
EDGE_FLOATS = st.sampled_from(
    [
        math.nan,
        math.inf,
        -math.inf,
        -0.0,
        0.0,
        5e-324,
        1e-45,
        1e-9,
        1e-50,
        0.5,
        1.0,
        1.0000001,
        2.0,
        2.0000001,
        10.0,
        100.0,
        100.5,
        -100.5,
        3.5e38,
        1e308,
        -1e308,
        1.5,
        -1.0,
    ]
)


FLOATS = EDGE_FLOATS | st.floats()
NUMBERS = INTS | FLOATS
JSON_SCALARS = st.none() | st.booleans() | NUMBERS | STRINGS
JUNK = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(STRINGS, inner, max_size=4),
    max_leaves=8,
)
HOSTILE = NUMBERS | STRINGS | JUNK


# Hostile values aimed at one field's own parsing (mixed with the generic ones).
FIELD_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "logit_bias": st.one_of(
        st.dictionaries(
            st.sampled_from(
                ["9" * 5000, "9" * 11, "-1", " 5 ", "1e3", "\u0663", "", "5.0", "0x10", "384", "4294967296"]
            ),
            FLOATS | JUNK,
            max_size=3,
        ),
        st.just({str(i): 1 for i in range(301)}),
    ),
    "stop": st.one_of(
        st.lists(HOSTILE_TEXT, max_size=20), st.just([""]), st.just(["a"] * 17), st.just("x" * 257)
    ),
    "stop_token_ids": st.lists(INTS | JUNK, max_size=5),
    "stream_options": JUNK
    | st.fixed_dictionaries({}, optional={"include_usage": JUNK, "continuous_usage_stats": JUNK}),
    "max_tokens": INTS,
    "max_completion_tokens": INTS,
    "n": INTS,
    "best_of": INTS,
    "logprobs": INTS | JUNK,
    "top_logprobs": INTS,
    "seed": INTS,
    "top_k": INTS,
    "model": STRINGS | st.sampled_from(["gpt-4", "", "m" * 10_000]),
    "cache_salt": HOSTILE_TEXT | st.just("s" * 257),
    # vLLM's sampling extras
    "min_tokens": INTS | JUNK,
    "allowed_token_ids": st.lists(INTS | JUNK, max_size=5) | st.just(list(range(1025))),
    "bad_words": st.lists(HOSTILE_TEXT | JUNK, max_size=5) | st.just(["w"] * 65) | st.just(["x" * 257]),
    "include_stop_str_in_output": JUNK,
    "truncate_prompt_tokens": INTS | JUNK,
}
_EXTRAS = (
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
)


def token_ids(low: int = 0, high: int = VOCAB - 1, max_size: int = 8) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(low, high), min_size=1, max_size=max_size)


# -- OpenAI bodies ---------------------------------------------------------------------------------


def _sampling_fields(chat: bool) -> dict[str, st.SearchStrategy[Any]]:
    """Valid values of the sampling fields both OpenAI routes take (all optional)."""
    fields: dict[str, st.SearchStrategy[Any]] = {
        "n": st.integers(1, 3),
        "temperature": st.sampled_from([0, 0.0, 0.5, 1, 1.7, 2.0]) | st.floats(0, 2),
        "top_p": st.sampled_from([1e-9, 0.1, 0.9, 1]) | st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
        "min_p": st.floats(0, 1),
        "seed": st.integers(0, 2**63 - 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 10),
        "stop": VALID_TEXT.map(lambda s: s[:8]) | st.lists(VALID_TEXT.map(lambda s: s[:8]), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "cache_salt": VALID_TEXT.map(lambda s: s[:20]),
        "user": VALID_TEXT,
        "model": st.just(MODEL_PLACEHOLDER),
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
    }
    if chat:
        fields["logprobs"] = st.booleans()
        fields["max_completion_tokens"] = st.integers(1, 4)
    else:
        fields["logprobs"] = st.integers(0, 5)
    return fields


MODEL_PLACEHOLDER = "<served model>"  # replaced by the served model's name when sent
UNSUPPORTED_PARAMS = (
    "functions",
    "guided_whitespace_pattern",
    "structural_tag",
    "use_beam_search",
    "suffix",
    "best_of",
    "chat_template",
    "audio",
)


# Structured outputs (controlplane/src/pagedserve/controlplane/openai/structured.py): shapes near the valid ones, wrong in
# one place or not at all (a body that carries one counts as mutated: it must never be a 5xx);
# schemas, regexes and grammars that parse but do not compile reach the data plane's compiler.
# (short texts only: a 10,000-character regex takes the compiler seconds, a case's whole time)
_SHORT_TEXT = st.text(ANY_CHAR, max_size=40)
_SHORT_JUNK = st.recursive(
    st.none() | st.booleans() | NUMBERS | _SHORT_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_SHORT_TEXT, inner, max_size=4),
    max_leaves=8,
)
_SCHEMAS = st.sampled_from(
    [
        {"type": "object"},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"$ref": "#/$defs/missing"},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1},
        {"enum": []},
        {"type": "nope"},
        {"type": "string", "pattern": "("},
        {"anyOf": []},
        {"properties": {"\ud800": {"type": "string"}}},
    ]
)
_REGEXES = st.sampled_from(["[0-9]{2}", "(", "[", "\\", "a**", "(?=a)b", "a{2,1}", "\\p{Lu}"])
_GRAMMARS = st.sampled_from(['root ::= "a" | "b"', "root ::= undefined", "root ::=", 'x ::= "a"', "::="])
_STRUCTURED_KEYS = st.sampled_from(
    [
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "whitespace_pattern",
        "structural_tag",
        "disable_fallback",
    ]
)
STRUCTURED_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "response_format": _SHORT_JUNK
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", ""]) | _SHORT_JUNK},
        optional={
            "json_schema": _SHORT_JUNK
            | st.fixed_dictionaries(
                {},
                optional={
                    "name": st.sampled_from(["s", "a b", "x" * 65]) | _SHORT_TEXT | _SHORT_JUNK,
                    "schema": _SCHEMAS | _SHORT_JUNK,
                    "strict": _SHORT_JUNK,
                    "description": _SHORT_JUNK,
                },
            )
        },
    ),
    "structured_outputs": _SHORT_JUNK
    | st.dictionaries(
        _STRUCTURED_KEYS | _SHORT_TEXT,
        _SCHEMAS | _REGEXES | _GRAMMARS | st.lists(_SHORT_TEXT, max_size=3) | _SHORT_JUNK,
        max_size=3,
    ),
    "guided_json": _SCHEMAS | _SCHEMAS.map(json.dumps) | _SHORT_TEXT | _SHORT_JUNK,
    "guided_regex": _REGEXES | _SHORT_TEXT | _SHORT_JUNK,
    "guided_choice": st.lists(_SHORT_TEXT | _SHORT_JUNK, max_size=4) | st.just(["a"] * 257) | _SHORT_JUNK,
    "guided_grammar": _GRAMMARS | _SHORT_TEXT | _SHORT_JUNK,
}


def _valid_message() -> st.SearchStrategy[dict[str, Any]]:
    content = SHORT_TEXT | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT.map(lambda s: s[:6])}),
        min_size=1,
        max_size=2,
    )
    return st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": content}
    )


def _hostile_message() -> st.SearchStrategy[Any]:
    return st.one_of(
        JUNK,
        st.fixed_dictionaries({"role": HOSTILE, "content": STRINGS}),
        st.fixed_dictionaries({"role": st.just("user"), "content": HOSTILE}),
        st.fixed_dictionaries(
            {
                "role": st.just("user"),
                "content": st.lists(st.fixed_dictionaries({"type": STRINGS, "text": HOSTILE})),
            }
        ),
        st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": JUNK}),
        st.fixed_dictionaries({"role": st.just("tool"), "content": STRINGS, "name": STRINGS}),
    )


def _valid_prompt() -> st.SearchStrategy[Any]:
    return st.one_of(
        SHORT_TEXT,
        token_ids(3),
        st.lists(SHORT_TEXT, min_size=1, max_size=3),
        st.lists(token_ids(3), min_size=1, max_size=3),
    )


def _hostile_prompt() -> st.SearchStrategy[Any]:
    return st.one_of(
        HOSTILE,
        st.lists(INTS, max_size=6),
        st.lists(st.lists(INTS, max_size=3), max_size=3),
        st.lists(HOSTILE_TEXT, max_size=3),
        st.just([[5]] * 300),
        st.just("x" * (2**20 + 1)),
        st.just([1, "a"]),
        st.just([]),
    )


@dataclass
class Body:
    """A JSON body as (key, value) pairs (a key may repeat), how to render it, and whether it
    was left valid (`valid`: the server must answer it with 200)."""

    route: str
    pairs: list[tuple[str, Any]]
    valid: bool
    ensure_ascii: bool = True
    mutations: list[str] = field(default_factory=list)

    def render(self, model: str) -> bytes:
        def value(v: Any) -> Any:
            return model if v == MODEL_PLACEHOLDER else v

        parts = [
            f"{json.dumps(k, ensure_ascii=self.ensure_ascii)}: {json.dumps(value(v), ensure_ascii=self.ensure_ascii)}"
            for k, v in self.pairs
        ]
        return ("{" + ", ".join(parts) + "}").encode("utf-8", "surrogatepass")

    @property
    def streams(self) -> bool:
        return any(k == "stream" and v is True for k, v in self.pairs)


@st.composite
def openai_body(draw: st.DrawFn, route: str) -> Body:
    """A valid body for `route`, then 0-3 mutations: a field made hostile, a required one
    dropped, an unknown or unsupported field added, a key sent twice, raw UTF-8 rendering."""
    chat = route == "/v1/chat/completions"
    if route == "/tokenize":
        use_messages = draw(st.booleans())
        required = (
            {"messages": st.lists(_valid_message(), min_size=1, max_size=2)}
            if use_messages
            else {"prompt": SHORT_TEXT}
        )
        optional: dict[str, st.SearchStrategy[Any]] = {
            "model": st.just(MODEL_PLACEHOLDER),
            "add_special_tokens": st.just(False),
        }
        if use_messages:
            optional["add_generation_prompt"] = st.booleans()
    elif route == "/detokenize":
        required = {"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=8)}
        optional = {"model": st.just(MODEL_PLACEHOLDER)}
    else:
        required = (
            {"messages": st.lists(_valid_message(), min_size=1, max_size=2)}
            if chat
            else {"prompt": _valid_prompt()}
        )
        optional = _sampling_fields(chat)
        # Generation stays cheap: max_tokens 1-4 (rarely unset: the rest of the context).
        if draw(st.sampled_from([True] * 19 + [False])):
            required["max_tokens" if not chat or draw(st.booleans()) else "max_completion_tokens"] = (
                st.integers(1, 4)
            )
            optional.pop("max_completion_tokens", None)
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if chat and body.get("logprobs") is True and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 5))
    if "n" in body and not chat and draw(st.sampled_from([False] * 4 + [True])):
        body["best_of"] = body["n"]
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], list | str):
        body.pop("n", None)  # several prompts: one completion each keeps it cheap
        body.pop("best_of", None)
    pairs = list(body.items())
    out = Body(route, pairs, valid=True)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        _mutate(draw, out, chat)
    return out


def _mutate(draw: st.DrawFn, body: Body, chat: bool) -> None:
    kind = draw(
        st.sampled_from(
            [
                "hostile",
                "hostile",
                "hostile",
                "drop",
                "unknown",
                "unsupported",
                "structured",
                "duplicate",
                "raw",
            ]
        )
    )
    keys = [k for k, _ in body.pairs]
    label = kind
    if kind in ("hostile", "duplicate") or not keys:
        names = sorted(
            set(keys)
            | set(_sampling_fields(chat))
            | {"max_tokens", "prompt", "messages", "echo", "prompt_logprobs", *_EXTRAS}
        )
        name = draw(st.sampled_from(names))
        if name == "prompt":
            value = draw(_hostile_prompt())
        elif name == "messages":
            value = draw(st.lists(_hostile_message(), max_size=3) | HOSTILE)
        elif name in FIELD_HOSTILE and draw(st.booleans()):
            value = draw(FIELD_HOSTILE[name])
        else:
            value = draw(HOSTILE)
        label = f"{kind}:{name}"
        if kind == "duplicate":
            body.pairs.append((name, value))  # the last one wins, as in Python's json
        else:
            body.pairs = [(k, v) for k, v in body.pairs if k != name] + [(name, value)]
    elif kind == "drop":
        name = draw(st.sampled_from(keys))
        label = f"drop:{name}"
        body.pairs = [(k, v) for k, v in body.pairs if k != name]
    elif kind == "unknown":
        body.pairs.append((draw(STRINGS), draw(JUNK)))
    elif kind == "unsupported":
        body.pairs.append((draw(st.sampled_from(UNSUPPORTED_PARAMS)), draw(JUNK | st.just(True))))
    elif kind == "structured":
        name = draw(st.sampled_from(sorted(STRUCTURED_HOSTILE)))
        label = f"structured:{name}"
        body.pairs.append((name, draw(STRUCTURED_HOSTILE[name])))
    else:  # raw UTF-8 (a lone surrogate becomes bytes that are not UTF-8)
        body.ensure_ascii = False
        try:
            json.dumps(body.pairs, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the body is no longer valid UTF-8
            body.valid = False
        body.mutations.append(kind)
        return
    body.valid = False
    body.mutations.append(label)


def _deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


RAW_CORPUS: list[bytes] = [
    b"",
    b"{",
    b'{"prompt": ',
    b"[]",
    b"null",
    b"42",
    b'"prompt"',
    b"{}",
    b'{"prompt": NaN}',
    b'{"prompt": [5], "max_tokens": Infinity}',
    b'{"prompt": [5], "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": [5], "max_tokens": 1e999}',
    b'{"prompt": [5], "max_tokens": -0}',
    b'{"prompt": [5], "max_tokens": 2, "max_tokens": -1}',
    b'{"prompt": [5], "max_tokens": 2, "n": 2, "n": 4294967296}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "messages": []}',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    b'\xef\xbb\xbf{"prompt": [5], "max_tokens": 2}',
    b'{"prompt": [5], "max_tokens": 2}garbage',
    b'{"prompt": [5], "max_tokens": 2}{"prompt": [6]}',
    b'{"prompt": [5],, "max_tokens": 2}',
    b"{'prompt': [5]}",
    b'{"prompt": [5], "logit_bias": {"5": NaN}}',
    b'{"prompt": [5], "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
    _deep(50),
    _deep(5000),
    _deep(200_000),
    b'{"prompt": "' + b"\\u0000" * 1000 + b'", "max_tokens": 1}',
    b'{"prompt": [5], "max_tokens": 1, "logit_bias": {"\\u0663": 1}}',
    b'{"prompt": [5], "max_tokens": 1, "stop": ["\\udfff"]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tokens": [1]}',
]
"""Hand-written bodies that do not parse or hold what no JSON serializer writes (duplicate keys,
NaN, 5000-digit numbers, deep nesting, a BOM, trailing garbage, invalid UTF-8): every one is
sent to every route by test_raw_corpus_on_every_route."""
RAW_BODIES = st.binary(max_size=64) | st.sampled_from(RAW_CORPUS)


# -- routes, query strings, headers ---------------------------------------------------------------

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GET_PATHS = st.one_of(
    st.sampled_from(
        [
            "/v1/models",
            "/v1/models/",
            "/version",
            "/health",
            "/live",
            "/metrics",
            "/openapi.json",
            "/docs",
            "/redoc",
            "/",
            "/v1",
            "/v1/completions/",
            "//v1/models",
            "/v1/models/%00",
            "/v1/models/%ff%fe",
            "/v1/models/..%2f..%2fetc%2fpasswd",
            "/v1/models/" + "m" * 10_000,
            "/%2e%2e/%2e%2e",
            "/v1/models/" + MODEL_PLACEHOLDER,
        ]
    ),
    st.builds(
        lambda s: "/v1/models/" + urllib.parse.quote(s, safe="/"),
        st.text(ANY_CHAR.filter(lambda c: c < "\ud800" or c > "\udfff"), max_size=30),
    ),
    st.builds(lambda s: "/" + urllib.parse.quote(s, safe="/%"), st.text(max_size=30)),
)
QUERY = st.one_of(
    st.just(""),
    st.builds(
        lambda pairs: "?" + urllib.parse.urlencode(pairs),
        st.lists(st.tuples(st.text(max_size=10), st.text(max_size=20)), max_size=4),
    ),
    st.sampled_from(
        ["?", "?&&", "?a", "?a=1&a=2", "?%ff=%fe", "?" + "x" * 5000, "?model=gpt-4", "?stream=true"]
    ),
)
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
LATIN1 = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
)
AUTHORIZATION = st.one_of(
    st.just([f"Bearer {KEY}"]),
    st.just([f"Bearer {KEY}"]),
    st.just([]),
    st.sampled_from(
        [
            [f"bearer {KEY}"],
            [f"BEARER   {KEY}  "],
            [f"Bearer {KEY}", f"Bearer {KEY}"],
            [f"Bearer {KEY}", "Bearer wrong"],
            ["Bearer wrong"],
            ["Bearer"],
            ["Bearer "],
            [""],
            [KEY],
            ["Basic YWxwaGE6"],
            [f"Token {KEY}"],
            [f"Bearer {KEY}é"],
            ["Bearer " + "k" * 8000],
        ]
    ),
    st.lists(LATIN1, min_size=1, max_size=2),
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json",
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
        "Application/JSON",
        "application/vnd.api+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
        None,
    ]
)
HEADER_NAMES = st.sampled_from(
    [
        "x-request-id",
        "traceparent",
        "tracestate",
        "baggage",
        "accept",
        "accept-encoding",
        "content-encoding",
        "user-agent",
        "openai-organization",
        "x-forwarded-for",
        "cookie",
        "expect",
        "x-junk",
    ]
)
EXTRA_HEADERS = st.lists(
    st.tuples(
        HEADER_NAMES, LATIN1 | st.sampled_from(["gzip", "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x" * 300])
    ),
    max_size=3,
)


@dataclass
class HttpCase:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes | None
    valid: bool = False  # must be answered 200
    abandon: str = ""  # "before" the answer, or "during" it: the client hangs up
    note: str = ""


def headers_with(
    content_type: str | None, authorization: Sequence[str], extra: Sequence[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    out = [("authorization", v) for v in authorization]
    if content_type is not None:
        out.append(("content-type", content_type))
    return out + list(extra)


@st.composite
def http_body_case(draw: st.DrawFn, route: str, model: str) -> HttpCase:
    body = draw(openai_body(route))
    abandon = draw(st.sampled_from(["", "", "", "before", "during"])) if body.valid and body.streams else ""
    return HttpCase(
        "POST",
        route,
        headers_with("application/json", [f"Bearer {KEY}"]),
        body.render(model),
        valid=body.valid,
        abandon=abandon,
        note=",".join(body.mutations),
    )


@st.composite
def http_raw_case(draw: st.DrawFn) -> HttpCase:
    route = draw(st.sampled_from(ROUTES))
    content_type = draw(CONTENT_TYPES)
    return HttpCase("POST", route, headers_with(content_type, [f"Bearer {KEY}"]), draw(RAW_BODIES))


@st.composite
def http_route_case(draw: st.DrawFn, model: str) -> HttpCase:
    method = draw(METHODS)
    path = draw(GET_PATHS | st.sampled_from(ROUTES)).replace(MODEL_PLACEHOLDER, model) + draw(QUERY)
    body = None if method in ("GET", "HEAD", "OPTIONS") and draw(st.booleans()) else draw(RAW_BODIES)
    return HttpCase(method, path, headers_with(draw(CONTENT_TYPES), [f"Bearer {KEY}"]), body)


@st.composite
def http_header_case(draw: st.DrawFn, model: str) -> HttpCase:
    route = draw(st.sampled_from([*ROUTES, "/v1/models", "/version", "/health"]))
    headers = headers_with(draw(CONTENT_TYPES), draw(AUTHORIZATION), draw(EXTRA_HEADERS))
    if route in ("/v1/models", "/version", "/health"):
        return HttpCase("GET", route, headers, None)
    body = draw(openai_body(route))
    body.pairs = [(k, v) for k, v in body.pairs if k != "stream"]
    return HttpCase("POST", route, headers, body.render(model), note=",".join(body.mutations))


# -- gRPC ------------------------------------------------------------------------------------------

UINT32 = st.sampled_from([0, 1, 2, 3, 4, 20, 21, 128, 129, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
INT32 = st.sampled_from([-(2**31), -2, -1, 0, 1, 5, 2**31 - 1]) | st.integers(-(2**31), 2**31 - 1)
INT64 = st.sampled_from([-(2**63), -1, 0, 1, 2**63 - 1]) | st.integers(-(2**63), 2**63 - 1)
PB_FLOATS = EDGE_FLOATS | st.floats(width=32)
PB_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40) | st.sampled_from(
    ["", "x" * 257, "é" * 10_000, "a#b", "\x00", "#"]
)


def _valid_sampling() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 4)},
        optional={
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "top_k": st.sampled_from([-1, 0, 1, 5]),
            "min_p": st.floats(0, 1),
            "seed": st.integers(0, 2**63 - 1),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "ignore_eos": st.booleans(),
            "n": st.integers(1, 3),
            "logprobs": st.integers(0, 5),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.1, 10),
            "stop": st.lists(VALID_TEXT.map(lambda s: s[:8]), max_size=3),
            "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
        },
    )


HOSTILE_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": UINT32,
    "temperature": PB_FLOATS,
    "top_p": PB_FLOATS,
    "top_k": INT32,
    "min_p": PB_FLOATS,
    "seed": INT64,
    "stop_token_ids": st.lists(UINT32, max_size=4),
    "n": UINT32,
    "logprobs": UINT32,
    "prompt_logprobs": UINT32,
    "presence_penalty": PB_FLOATS,
    "frequency_penalty": PB_FLOATS,
    "repetition_penalty": PB_FLOATS,
    "stop": st.lists(PB_TEXT, max_size=20),
    "logit_bias": st.dictionaries(UINT32, PB_FLOATS, max_size=4) | st.just({i: 1.0 for i in range(301)}),
    "min_tokens": UINT32,
    "allowed_token_ids": st.lists(UINT32, max_size=4) | st.just(list(range(1025))),
    "truncate_prompt_tokens": UINT32,
    "bad_words": st.lists(PB_TEXT, max_size=4) | st.just(["w"] * 65),
}


@dataclass
class GrpcCase:
    method: str
    payload: bytes
    metadata: list[tuple[str, str]]
    valid: bool = False  # must end OK
    abandon: bool = False  # cancelled after its first response
    note: str = ""


def _sampling_message(values: dict[str, Any]) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for name, value in values.items():
        if name in ("stop_token_ids", "stop", "allowed_token_ids", "bad_words"):
            getattr(msg, name).extend(value)
        elif name == "logit_bias":
            for k, v in value.items():
                msg.logit_bias[k] = v
        else:
            setattr(msg, name, value)
    return msg


@st.composite
def grpc_generate_case(draw: st.DrawFn, model: str) -> GrpcCase:
    """A GenerateRequest built with the typed API: valid, or with 1-3 fields (anywhere in the
    message) set to values the types hold but the server must refuse."""
    sampling = draw(_valid_sampling())
    msg = generation_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["text", "token_ids", "chat"]))
    if kind == "text":
        msg.text = draw(SHORT_TEXT)
    elif kind == "token_ids":
        msg.token_ids.ids.extend(draw(token_ids(3)))
    else:
        for m in draw(st.lists(_valid_message(), min_size=1, max_size=2)):
            content = (
                m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
            )
            msg.chat.messages.add(role=m["role"], content=content)
    if draw(st.booleans()):
        msg.request_id = draw(PB_TEXT.map(lambda s: s[:100]))
    if draw(st.booleans()):
        msg.model = model
    if draw(st.booleans()):
        msg.cache_salt = draw(VALID_TEXT.map(lambda s: s[:20]))
    valid = True
    notes = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        target = draw(
            st.sampled_from(
                [*HOSTILE_SAMPLING, "prompt", "model", "request_id", "cache_salt", "unset_max_tokens"]
            )
        )
        notes.append(target)
        if target in HOSTILE_SAMPLING:
            sampling[target] = draw(HOSTILE_SAMPLING[target])
        elif target == "unset_max_tokens":
            sampling.pop("max_tokens", None)
            continue  # still valid: the rest of the context
        elif target == "prompt":
            which = draw(st.sampled_from(["none", "ids", "text", "chat"]))
            if which == "none":
                msg.ClearField(msg.WhichOneof("prompt") or "text")
            elif which == "ids":
                msg.token_ids.ids[:] = draw(st.lists(UINT32, max_size=6))
            elif which == "text":
                msg.text = draw(PB_TEXT | st.just("x" * (2**20 + 1)))
            else:
                del msg.chat.messages[:]
                for _ in range(draw(st.integers(0, 3))):
                    msg.chat.messages.add(role=draw(PB_TEXT), content=draw(PB_TEXT))
        else:
            setattr(msg, target, draw(PB_TEXT))
        valid = False
    msg.sampling_params.CopyFrom(_sampling_message(sampling))
    abandon = valid and draw(st.sampled_from([False] * 7 + [True]))
    return GrpcCase(
        "Generate", msg.SerializeToString(), [AUTH], valid=valid, abandon=abandon, note=",".join(notes)
    )


@st.composite
def grpc_small_rpc_case(draw: st.DrawFn, model: str) -> GrpcCase:
    method = draw(st.sampled_from(["Tokenize", "Detokenize", "ListModels"]))
    model_value = draw(st.sampled_from(["", model]) | PB_TEXT)
    if method == "Tokenize":
        tok = generation_pb2.TokenizeRequest(model=model_value)
        if draw(st.booleans()):
            tok.text = draw(PB_TEXT | st.just("x" * (2**20 + 1)))
        elif draw(st.booleans()):
            for _ in range(draw(st.integers(0, 3))):
                tok.chat.messages.add(
                    role=draw(st.sampled_from(["user", "system"]) | PB_TEXT), content=draw(PB_TEXT)
                )
        payload = tok.SerializeToString()
    elif method == "Detokenize":
        payload = generation_pb2.DetokenizeRequest(
            model=model_value, token_ids=draw(st.lists(UINT32 | st.integers(0, VOCAB - 1), max_size=8))
        ).SerializeToString()
    else:
        payload = generation_pb2.ListModelsRequest().SerializeToString()
    return GrpcCase(method, payload, [AUTH])


# Raw protobuf wire encoding, to send what no typed client can: out-of-type varints, wrong
# wire types, repeated singular fields, truncated and invalid UTF-8 strings, unknown fields.


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def wire_field(number: int, wire_type: int, value: int | bytes) -> bytes:
    tag = varint((number << 3) | wire_type)
    if wire_type == 0:
        assert isinstance(value, int)
        return tag + varint(value)
    if wire_type in (6, 7):  # no such wire type
        return tag
    if wire_type == 1:
        return tag + (value if isinstance(value, bytes) else struct.pack("<Q", value & (2**64 - 1)))[
            :8
        ].ljust(8, b"\0")
    if wire_type == 5:
        return tag + (value if isinstance(value, bytes) else struct.pack("<I", value & (2**32 - 1)))[
            :4
        ].ljust(4, b"\0")
    if wire_type in (3, 4):  # a group's start or end (proto3 has none)
        return tag
    data = value if isinstance(value, bytes) else varint(value)
    return tag + varint(len(data)) + data


WIRE_INTS = st.sampled_from(
    [0, 1, 2, 4, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1, -1, -(2**31)]
) | st.integers(-(2**63), 2**64 - 1)
WIRE_BYTES = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\x80", b"a#b", b"", b"\x00"]),
    PB_TEXT.map(lambda s: s.encode()),
)


@st.composite
def wire_entries(
    draw: st.DrawFn, numbers: Sequence[int], nested: dict[int, Callable[[st.DrawFn], bytes]]
) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 8))):
        number = draw(st.sampled_from(list(numbers)) | st.integers(1, 2**29 - 1) | st.just(0))
        if number in nested and draw(st.booleans()):
            out += wire_field(number, 2, nested[number](draw))
            continue
        wire_type = draw(st.sampled_from([0, 0, 1, 2, 2, 5, 3, 4, 6, 7]))
        value: int | bytes = draw(WIRE_INTS) if wire_type in (0, 1, 5) else draw(WIRE_BYTES)
        out += wire_field(number, wire_type, value)
    return out


def _wire_sampling(draw: st.DrawFn) -> bytes:
    entries = draw(wire_entries(range(1, 16), {15: lambda d: d(wire_entries((1, 2), {}))}))
    if draw(st.booleans()):  # a small max_tokens first: a decodable message stays cheap to run
        entries = wire_field(1, 0, draw(st.integers(1, 4))) + entries
    return entries


def _wire_chat(draw: st.DrawFn) -> bytes:
    return draw(wire_entries((1,), {1: lambda d: d(wire_entries((1, 2), {}))}))


def _wire_token_ids(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):  # packed
        return wire_field(
            1,
            2,
            b"".join(varint(v) for v in draw(st.lists(WIRE_INTS | st.integers(0, VOCAB - 1), max_size=6))),
        )
    return draw(wire_entries((1,), {}))


@st.composite
def grpc_wire_case(draw: st.DrawFn) -> GrpcCase:
    """Bytes for a method: random, a valid message mutated, or raw wire entries."""
    method = draw(st.sampled_from([*GRPC_METHODS, "Generate", "Generate", "NoSuchMethod"]))
    kind = draw(st.sampled_from(["random", "mutated", "wire", "wire", "wire"]))
    if kind == "random":
        payload = draw(st.binary(max_size=256))
    elif kind == "mutated":
        base = generation_pb2.GenerateRequest(
            request_id="r",
            text="Say hello.",
            sampling_params=common_pb2.SamplingParams(max_tokens=2, n=1, stop=["x"]),
        ).SerializeToString()
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
            at = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=4))
            elif op == "delete" and data:
                del data[at]
            elif op == "truncate":
                del data[at:]
        payload = bytes(data)
    else:
        nested = {4: _wire_token_ids, 5: _wire_chat, 6: _wire_sampling}
        payload = draw(wire_entries(range(1, 8), nested))
    return GrpcCase(method, payload, [AUTH], note=kind)


GRPC_AUTHORIZATION = st.one_of(
    st.just([f"Bearer {KEY}"]),
    st.just([]),
    st.sampled_from(
        [
            [f"bearer {KEY}"],
            [f"Bearer {KEY}", f"Bearer {KEY}"],
            ["Bearer wrong", f"Bearer {KEY}"],
            ["Bearer"],
            [""],
            [KEY],
            ["Basic YWxwaGE6"],
            ["Bearer " + "k" * 8000],
        ]
    ),
    st.lists(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30), min_size=1, max_size=2
    ),
)
GRPC_EXTRA_METADATA = st.lists(
    st.tuples(
        st.sampled_from(["traceparent", "tracestate", "x-request-id", "user-agent-x", "x-junk"]),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60),
    ),
    max_size=3,
)


@st.composite
def grpc_metadata_case(draw: st.DrawFn, model: str) -> GrpcCase:
    case = draw(grpc_generate_case(model) | grpc_small_rpc_case(model))
    metadata = [("authorization", v) for v in draw(GRPC_AUTHORIZATION)] + draw(GRPC_EXTRA_METADATA)
    return GrpcCase(case.method, case.payload, metadata, note=case.note)


# -- sending and judging ---------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    content: bytes
    seconds: float
    partial: bool = False  # the client hung up after the first bytes


class Client:
    """Sends one case per connection, duplicate headers and odd paths exactly as given."""

    def __init__(self, http_url: str, grpc_address: str) -> None:
        host, port = http_url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.grpc_address = grpc_address
        self.channel = grpc.insecure_channel(grpc_address)

    def close(self) -> None:
        self.channel.close()

    def http(self, case: HttpCase) -> Answer | None:
        started = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=CASE_TIMEOUT_S)
        try:
            conn.putrequest(case.method, case.path, skip_host=False, skip_accept_encoding=True)
            for name, value in case.headers:
                conn.putheader(name, value.encode("latin-1"))
            if case.body is not None:
                conn.putheader("content-length", str(len(case.body)))
            conn.endheaders(case.body)
            if case.abandon == "before":
                return None  # hang up at once: the server must abort what it started
            response = conn.getresponse()
            if case.abandon == "during":  # the first bytes of the answer, then hang up
                headers = {k.lower(): v for k, v in response.getheaders()}
                return Answer(response.status, headers, response.read(64), time.monotonic() - started, True)
            content = response.read()
            headers = {k.lower(): v for k, v in response.getheaders()}
            return Answer(response.status, headers, content, time.monotonic() - started)
        finally:
            conn.close()

    def grpc(self, case: GrpcCase) -> tuple[grpc.StatusCode, str, list[bytes], float]:
        started = time.monotonic()
        path = f"{SERVICE}/{case.method}"
        metadata = tuple(case.metadata)
        responses: list[bytes] = []
        try:
            if case.method == "Generate":
                call = self.channel.unary_stream(path)(
                    case.payload, timeout=CASE_TIMEOUT_S, metadata=metadata
                )
                for response in call:
                    responses.append(response)
                    if case.abandon:
                        call.cancel()
                        return grpc.StatusCode.CANCELLED, "", responses, time.monotonic() - started
            else:
                responses.append(
                    self.channel.unary_unary(path)(case.payload, timeout=CASE_TIMEOUT_S, metadata=metadata)
                )
        except grpc.RpcError as exc:
            if case.abandon and exc.code() == grpc.StatusCode.CANCELLED:
                return grpc.StatusCode.CANCELLED, "", responses, time.monotonic() - started
            return exc.code(), exc.details() or "", responses, time.monotonic() - started
        return grpc.StatusCode.OK, "", responses, time.monotonic() - started


def check_http(case: HttpCase, answer: Answer | None) -> None:
    """What every HTTP answer must be."""
    if answer is None:
        return  # abandoned by the client
    where = f"{case.method} {case.path[:120]} {case.note} body={case.body[:300] if case.body else None!r}"
    assert answer.status < 500, f"{answer.status} for {where}: {answer.content[:500]!r}"
    assert answer.seconds < CASE_TIMEOUT_S, f"{answer.seconds:.1f} s for {where}"
    content_type = answer.headers.get("content-type", "")
    if case.method == "HEAD" or answer.partial:
        return
    if answer.status >= 400:
        if answer.status == 400 and content_type.startswith("text/plain"):
            # uvicorn's answer to what is not HTTP at all (before any route runs)
            assert answer.content == b"Invalid HTTP request received.", where
            return
        assert content_type == "application/json", f"{content_type} for {where}"
        body = json.loads(answer.content)
        assert set(body) == {"error"}, f"{body} for {where}"
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{error} for {where}"
        assert isinstance(error["message"], str) and 0 < len(error["message"]) <= MAX_MESSAGE_CHARS, where
        assert error["param"] is None or (isinstance(error["param"], str) and len(error["param"]) <= 256), (
            where
        )
        assert error["code"] not in ("internal", "unknown"), where
        assert error["type"] != "server_error", where
        assert not case.valid, f"a valid request was refused: {error} for {where}"
        return
    if case.valid:
        assert answer.status == 200, f"{answer.status} for a valid request: {where}"
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in answer.content.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {where}"
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:
                assert chunk["error"]["code"] not in ("internal", "unknown"), f"{chunk} for {where}"
                assert not case.valid, f"a valid request failed in its stream: {chunk} for {where}"
    elif content_type == "application/json" and answer.status == 200:
        json.loads(answer.content)


def check_grpc(case: GrpcCase, code: grpc.StatusCode, details: str, seconds: float) -> None:
    where = f"{case.method} {case.note} payload={case.payload[:200]!r} metadata={[(k, v[:40]) for k, v in case.metadata]}"
    if case.abandon and code == grpc.StatusCode.CANCELLED:
        return
    assert code in GRPC_ALLOWED, f"{code} ({details[:300]!r}) after {seconds:.1f} s for {where}"
    assert seconds < CASE_TIMEOUT_S, f"{seconds:.1f} s for {where}"
    assert len(details) <= MAX_MESSAGE_CHARS, f"{len(details)}-character details for {where}"
    if case.valid:
        assert code == grpc.StatusCode.OK, f"a valid request ended {code}: {details!r} for {where}"
