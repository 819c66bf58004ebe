"""The Embed RPC's request and answer for the Python client (client.py's `embed`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2

EmbedInput = str | Sequence[int]
POOLING_TYPES = {
    "last": common_pb2.PoolingParams.POOLING_TYPE_LAST,
    "mean": common_pb2.PoolingParams.POOLING_TYPE_MEAN,
    "cls": common_pb2.PoolingParams.POOLING_TYPE_CLS,
}


def build_embed_request(
    inputs: EmbedInput | Sequence[EmbedInput],
    *,
    pooling: str = "last",
    normalize: bool = True,
    model: str = "",
    request_id: str = "",
    priority: int = 0,
) -> generation_pb2.EmbedRequest:
    """An EmbedRequest: one text, one token-id list, or a list of either; `pooling` is last,
    mean or cls."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    items: list[Any] = (
        [inputs] if isinstance(inputs, str) or all(isinstance(t, int) for t in inputs) else list(inputs)
    )
    request = generation_pb2.EmbedRequest(
        model=model,
        request_id=request_id,
        priority=priority,
        pooling=common_pb2.PoolingParams(pooling_type=POOLING_TYPES[pooling], normalize=normalize),
    )
    for item in items:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add(token_ids=generation_pb2.TokenIds(ids=list(item)))
    return request


def vectors(response: generation_pb2.EmbedResponse) -> list[list[float]]:
    """The embeddings of an EmbedResponse, in input order."""
    return [list(e.values) for e in sorted(response.embeddings, key=lambda e: e.index)]
