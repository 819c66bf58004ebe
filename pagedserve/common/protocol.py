"""Conversions between the wire messages and plane-neutral Python types, one table each.
Imports no torch.

Both planes use these: the control plane to validate a request before admitting it, the
data plane to build the engine's SamplingParams from a submit command; clients name finish
reasons with the same table.
"""

from __future__ import annotations

from dataclasses import fields

from pagedserve.common.sampling_params import SamplingParams
from protos.pagedserve.v1 import common_pb2

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}

# The one finish-reason table: wire enum <-> the name APIs, metrics and the engine use.
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
FINISH_REASON_BY_NAME = {name: value for value, name in FINISH_REASON_NAMES.items()}


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a wire message; raises ValueError naming the bad field.

    Unset optional fields keep the engine's defaults. Stop strings are not part of it: the
    control plane matches them on the text it detokenizes.
    """
    kwargs: dict[str, object] = {}
    for name in _OPTIONAL_FIELDS:
        if name in _PARAM_NAMES and msg.HasField(name):  # type: ignore[arg-type]
            kwargs[name] = getattr(msg, name)
    if "temperature" in kwargs:
        # float32 on the wire: 0.7 arrives as 0.699999988; round to what the client wrote.
        kwargs["temperature"] = round(float(kwargs["temperature"]), 6)  # type: ignore[arg-type]
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kwargs:
            kwargs[name] = round(float(kwargs[name]), 6)  # type: ignore[arg-type]
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    return SamplingParams(**kwargs)  # type: ignore[arg-type]
