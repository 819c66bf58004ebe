"""Conversions between the wire messages and the engine's types. Imports no torch.

Both planes use these: the control plane to validate a request before admitting it, the
data plane to build the engine's SamplingParams from a submit command.
"""

from __future__ import annotations

from dataclasses import fields

from dataplane.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecord
from dataplane.sampling_params import SamplingParams
from dataplane.scheduler.request import RequestStatus
from protos.pagedserve.v1 import common_pb2, dataplane_pb2

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

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


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


def kv_event_to_proto(record: KVEventRecord) -> dataplane_pb2.KVEvent:
    event = record.event
    if isinstance(event, BlockStored):
        return dataplane_pb2.KVEvent(
            seq=record.seq,
            stored=dataplane_pb2.BlockStoredEvent(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash or b""
            ),
        )
    if isinstance(event, BlockRemoved):
        return dataplane_pb2.KVEvent(
            seq=record.seq, removed=dataplane_pb2.BlockRemovedEvent(block_hashes=list(event.block_hashes))
        )
    if isinstance(event, AllBlocksCleared):
        return dataplane_pb2.KVEvent(seq=record.seq, cleared=dataplane_pb2.AllBlocksClearedEvent())
    raise TypeError(f"unknown KV event {event!r}")
