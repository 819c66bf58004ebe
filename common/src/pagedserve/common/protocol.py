"""Conversions between the wire messages and plane-neutral Python types, one table each.
Imports no torch.

The control plane validates what a client sent into SamplingParams once, at its edge
(`sampling_params_from_fields`), and puts exactly those on the wire
(`sampling_params_to_proto`); the data plane rebuilds the same SamplingParams from the submit
command (`sampling_params_from_proto`). Clients name finish reasons with the same table.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import fields

from pagedserve.common.constraints import Constraint
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    InvalidField,
    SamplingParams,
)
from pagedserve.protos.pagedserve.v1 import common_pb2

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "speculative",
)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# The largest value each integer field's wire type holds (uint32, int32, int64).
_UINT32_MAX = 2**32 - 1
_WIRE_MAX = {
    "max_tokens": _UINT32_MAX,
    "min_tokens": _UINT32_MAX,
    "n": _UINT32_MAX,
    "logprobs": _UINT32_MAX,
    "prompt_logprobs": _UINT32_MAX,
    "top_k": 2**31 - 1,
    "seed": 2**63 - 1,
}
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}

# The one finish-reason table: wire enum <-> the name APIs, metrics and the engine use.
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",  # the control plane's chat responses only
}
FINISH_REASON_BY_NAME = {name: value for value, name in FINISH_REASON_NAMES.items()}


def _float32(value: float) -> float:
    single: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return single


def wire_float(value: float) -> float:
    """`value` as the data plane reads it back: through the wire's float32, then the shortest
    decimal that float32 maps to the same value.

    float32 turns 0.7 into 0.699999988; the shortest decimal restores what the client wrote
    (0.7), and tiny values keep their magnitude (1e-9 stays 1e-9, it is not rounded to 0).
    The result maps to itself, so applying this at the edge makes the control plane validate
    the very value the data plane will use.
    """
    try:
        single = _float32(value)
    except OverflowError:  # beyond float32's range: the wire carries an infinity
        return math.copysign(math.inf, value)
    if not math.isfinite(single) or single == 0.0:
        return single
    for digits in range(1, 10):  # 9 significant digits always identify a float32
        shortest = float(f"{single:.{digits}g}")
        try:
            if _float32(shortest) == single:
                return shortest
        except OverflowError:  # near float32's largest value a short decimal rounds past it
            continue
    return single


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return math.inf if value > 0 else -math.inf


def sampling_params_from_fields(values: Mapping[str, object]) -> SamplingParams:
    """SamplingParams from the fields a client set (named as SamplingParams names them; unset
    ones keep its defaults); raises `InvalidField` (a ValueError) naming the bad field.

    Floats are taken at wire precision and integers must fit their wire type (checked on the
    Python values, before any wire message is built), so that
    `sampling_params_from_proto(sampling_params_to_proto(p)) == p` for the result.
    """
    kwargs = dict(values)
    unknown = sorted(set(kwargs) - _PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown sampling fields: {', '.join(unknown)}")
    for name in _FLOAT_FIELDS:
        value = kwargs.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            kwargs[name] = wire_float(_as_float(value))
    words = kwargs.get("bad_words_token_ids")
    if isinstance(words, list):
        kwargs["bad_words_token_ids"] = tuple(tuple(w) if isinstance(w, list) else w for w in words)
    bias = kwargs.get("logit_bias")
    if isinstance(bias, Mapping):
        kwargs["logit_bias"] = {
            k: wire_float(_as_float(v)) if isinstance(v, int | float) and not isinstance(v, bool) else v
            for k, v in bias.items()
        }
    stop_ids = kwargs.get("stop_token_ids", ())
    if isinstance(stop_ids, list):
        kwargs["stop_token_ids"] = tuple(stop_ids)
    allowed = kwargs.get("allowed_token_ids")
    if isinstance(allowed, list):
        kwargs["allowed_token_ids"] = tuple(allowed)
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    for name, top in _WIRE_MAX.items():
        value = getattr(params, name)
        if value is not None and value > top:
            raise InvalidField(name, f"must be at most {top}, got {value}")
    if any(t > _UINT32_MAX for t in params.stop_token_ids):
        raise InvalidField("stop_token_ids", f"must be at most {_UINT32_MAX}")
    if any(t > _UINT32_MAX for w in params.bad_words_token_ids for t in w):
        raise InvalidField("bad_words_token_ids", f"must be at most {_UINT32_MAX}")
    if any(t > _UINT32_MAX for t in params.allowed_token_ids or ()):
        raise InvalidField("allowed_token_ids", f"must be at most {_UINT32_MAX}")
    if any(t > _UINT32_MAX for t, _ in params.logit_bias):
        raise InvalidField("logit_bias", f"keys must be at most {_UINT32_MAX}")
    return params


def sampling_fields_from_proto(msg: common_pb2.SamplingParams) -> dict[str, object]:
    """The fields a wire message sets, named as SamplingParams names them (for
    `sampling_params_from_fields`). Stop strings are not among them: the control plane
    matches them on the text it detokenizes."""
    values: dict[str, object] = {}
    for name in _OPTIONAL_FIELDS:
        if name in _PARAM_NAMES and msg.HasField(name):  # type: ignore[arg-type]
            values[name] = getattr(msg, name)
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        # Refused before the ids are copied out of the message: 2 M of them took the data
        # plane's engine thread ~0.3 s just to convert before SamplingParams refused them.
        count = len(msg.stop_token_ids)
        raise InvalidField("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {count}")
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    if len(msg.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        count = len(msg.allowed_token_ids)
        raise InvalidField(
            "allowed_token_ids", f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {count}"
        )
    if msg.allowed_token_ids:
        values["allowed_token_ids"] = tuple(msg.allowed_token_ids)
    if msg.bad_words_token_ids:
        if sum(len(w.ids) for w in msg.bad_words_token_ids) > MAX_BAD_WORDS_TOKEN_IDS:
            limit = f"at most {MAX_BAD_WORDS_TOKEN_IDS} token ids in all"
            raise InvalidField("bad_words_token_ids", f"must hold {limit}")
        values["bad_words_token_ids"] = tuple(tuple(w.ids) for w in msg.bad_words_token_ids)
    values["ignore_eos"] = msg.ignore_eos
    if msg.logit_bias:
        values["logit_bias"] = dict(msg.logit_bias)
    constraint = constraint_from_proto(msg)
    if constraint is not None:
        values["constraint"] = constraint
    return values


def constraint_from_proto(msg: common_pb2.SamplingParams) -> Constraint | None:
    """The `constraint` oneof of a wire message, None when unset; raises InvalidField naming
    the kind."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidField("json_object", "must be true when set")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, kind))


def _set_constraint(msg: common_pb2.SamplingParams, constraint: Constraint) -> None:
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.choices.extend(constraint.choices)
    else:
        setattr(msg, constraint.kind, constraint.value)


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a wire message (unset optional fields keep the engine's
    defaults); raises ValueError naming the bad field."""
    return sampling_params_from_fields(sampling_fields_from_proto(msg))


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire message for `params`, every field set so the data plane applies no default of
    its own. Stop strings are not part of it (the control plane matches them)."""
    if params.best_of is not None and params.best_of != params.n:
        raise ValueError(f"best_of: the wire carries n only, so best_of must equal n ({params.n})")
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        n=params.n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        allowed_token_ids=params.allowed_token_ids or (),
        bad_words_token_ids=[common_pb2.TokenIdSequence(ids=w) for w in params.bad_words_token_ids],
    )
    if params.seed is not None:
        msg.seed = params.seed
    if not params.speculative:
        msg.speculative = False
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.constraint is not None:
        _set_constraint(msg, params.constraint)
    return msg


_POOLING_TYPES = {
    common_pb2.PoolingParams.POOLING_TYPE_UNSPECIFIED: "last",
    common_pb2.PoolingParams.POOLING_TYPE_LAST: "last",
    common_pb2.PoolingParams.POOLING_TYPE_MEAN: "mean",
    common_pb2.PoolingParams.POOLING_TYPE_CLS: "cls",
}
_POOLING_TYPE_BY_NAME = {"last": common_pb2.PoolingParams.POOLING_TYPE_LAST} | {
    name: value for value, name in _POOLING_TYPES.items() if name != "last"
}


def pooling_params_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """The PoolingParams a wire message asks for (unset fields: the defaults); an unknown
    pooling type raises InvalidField("pooling_type")."""
    name = _POOLING_TYPES.get(msg.pooling_type)
    if name is None:
        raise InvalidField("pooling_type", f"is not a known pooling type, got {msg.pooling_type}")
    return PoolingParams(name, msg.normalize if msg.HasField("normalize") else True)


def pooling_params_to_proto(params: PoolingParams) -> common_pb2.PoolingParams:
    return common_pb2.PoolingParams(
        pooling_type=_POOLING_TYPE_BY_NAME[params.pooling_type], normalize=params.normalize
    )
