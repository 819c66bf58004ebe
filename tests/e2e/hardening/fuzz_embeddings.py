"""What the fuzz suite (test_fuzz.py) sends to the embeddings APIs: `POST /v1/embeddings` and
the gRPC `Embed` RPC.

Valid requests embed 1-3 short inputs (texts or token ids: they fit the tiny model's context)
with any encoding format and pooling; hostile ones set 1-3 fields to wrong types, huge or
negative numbers, lone surrogates, empty or out-of-vocabulary inputs, too many inputs, junk,
unknown fields and duplicate keys. HTTP answers are judged by `fuzz_cases.check_http` (the
OpenAI error shape), gRPC ones by `check_grpc`: never a 5xx / INTERNAL, a valid one answered.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2
from tests.e2e.hardening import fuzz_cases as fc

ROUTE = "/v1/embeddings"
_INPUT = st.one_of(
    fc.SHORT_TEXT,
    st.lists(fc.SHORT_TEXT, min_size=1, max_size=3),
    fc.token_ids(3),
    st.lists(fc.token_ids(3), min_size=1, max_size=3),
)
_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(fc.MODEL_PLACEHOLDER),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "user": fc.SHORT_TEXT,
    "normalize": st.booleans(),
    "pooling_type": st.sampled_from(["last", "mean", "cls"]),
    "priority": st.integers(-10, 10),
}
_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(
        st.just(""),
        st.just([]),
        st.just([[]]),
        st.lists(fc.INTS, min_size=1, max_size=4),
        st.lists(st.lists(fc.INTS, max_size=3), min_size=1, max_size=3),
        st.lists(fc.HOSTILE, max_size=3),
        st.just(["x"] * 257),
        fc.HOSTILE,
    ),
    "dimensions": fc.INTS,
    "encoding_format": fc.STRINGS,
    "pooling_type": fc.STRINGS,
    "normalize": fc.HOSTILE,
    "truncate_prompt_tokens": fc.INTS,
    "priority": fc.INTS,
    "model": fc.STRINGS,
}


@st.composite
def embeddings_case(draw: st.DrawFn, model: str) -> fc.HttpCase:
    """A /v1/embeddings body: valid, then 0-3 mutations."""
    body = fc.Body(
        ROUTE, list(draw(st.fixed_dictionaries({"input": _INPUT}, optional=_OPTIONAL)).items()), True
    )
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["hostile", "hostile", "hostile", "drop", "unknown", "duplicate"]))
        name = draw(st.sampled_from(sorted({*_HOSTILE, *(k for k, _ in body.pairs)})))
        value = draw(_HOSTILE[name]) if name in _HOSTILE and draw(st.booleans()) else draw(fc.HOSTILE)
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
    headers = fc.headers_with("application/json", [f"Bearer {fc.KEY}"])
    return fc.HttpCase("POST", ROUTE, headers, body.render(model), body.valid, "", ",".join(body.mutations))


@st.composite
def grpc_embed_case(draw: st.DrawFn, model: str) -> fc.GrpcCase:
    """An EmbedRequest built with the typed API: valid, or with 1-3 parts made hostile."""
    msg = generation_pb2.EmbedRequest()
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            msg.inputs.add(text=draw(fc.SHORT_TEXT))
        else:
            msg.inputs.add(token_ids=generation_pb2.TokenIds(ids=draw(fc.token_ids(3))))
    if draw(st.booleans()):
        msg.model = model
    if draw(st.booleans()):
        msg.pooling.pooling_type = common_pb2.PoolingParams.PoolingType.ValueType(
            draw(st.sampled_from([0, 1, 2, 3]))
        )
        msg.pooling.normalize = draw(st.booleans())
    notes = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        target = draw(
            st.sampled_from(
                ["empty", "no_input", "text", "ids", "count", "pooling", "model", "priority", "truncate"]
            )
        )
        notes.append(target)
        if target == "empty":
            del msg.inputs[:]
        elif target == "no_input":
            msg.inputs.add()
        elif target == "text":
            msg.inputs.add(text=draw(fc.PB_TEXT.filter(lambda s: not s) | st.just("x" * (2**20 + 1))))
        elif target == "ids":
            msg.inputs.add(token_ids=generation_pb2.TokenIds(ids=draw(st.lists(fc.UINT32, max_size=4))))
        elif target == "count":
            msg.inputs.extend([generation_pb2.EmbedInput(text="x")] * 257)
        elif target == "pooling":
            msg.pooling.pooling_type = draw(st.integers(4, 2**31 - 1))  # type: ignore[assignment]
        elif target == "model":
            msg.model = draw(fc.PB_TEXT.filter(lambda s: s != model))
        elif target == "priority":
            msg.priority = draw(st.sampled_from([-(2**31), 2**31 - 1, 1_000_001]))
        else:
            msg.truncate_prompt_tokens = 0
    payload = msg.SerializeToString()
    return fc.GrpcCase("Embed", payload, [fc.AUTH], valid=not notes, note=",".join(notes))
