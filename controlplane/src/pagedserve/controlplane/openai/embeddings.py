"""`POST /v1/embeddings`, OpenAI's embeddings API over the paged engine (controlplane/embeddings.py).

`input` is a string, a list of strings, a list of token ids or a list of such lists (at most
MAX_EMBED_INPUTS inputs, each 1 to max_model_len tokens; text is tokenized with no special
tokens added, as prompts are everywhere here); `encoding_format` "float" (default) or "base64"
(the little-endian fp32 bytes, as OpenAI's); `user` is accepted and ignored. `dimensions` is
refused with 400 naming it: no served model declares reduced (Matryoshka) dimensions. vLLM's
extras `normalize`, `truncate_prompt_tokens` and `priority` are honoured, and `pooling_type`
(last, mean or cls; default last) picks the pooling. No torch.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from pagedserve.common.invalid_field import InvalidField
from pagedserve.common.pooling_params import DEFAULT_POOLING_TYPE, PoolingParams
from pagedserve.controlplane.embeddings import Embedder
from pagedserve.controlplane.errors import invalid_argument
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.openai.streaming import unless_disconnected

CLIENT_CLOSED_REQUEST = 499  # as the other routes: the client went away first


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None  # omitted: the served model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras, and the pooling (ours)
    normalize: StrictBool = True
    truncate_prompt_tokens: int | None = None
    priority: int | None = None
    pooling_type: str = DEFAULT_POOLING_TYPE


def encoded(values: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the client asked: JSON floats, or base64 of its little-endian fp32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


class EmbeddingRoutes:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.embedder = Embedder(frontend)
        self.router = APIRouter()
        self.router.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"], response_model=None)

    def _inputs(
        self, value: str | list[str] | list[int] | list[list[int]]
    ) -> tuple[list[list[int]], list[str]]:
        """Each input's token ids and the field that names it."""
        if isinstance(value, str):
            return [self.embedder.token_ids(value, "input")], ["input"]
        self.embedder.check_count(len(value), "input")
        if all(isinstance(v, int) for v in value):
            return [self.embedder.token_ids(value, "input")], ["input"]  # type: ignore[arg-type]
        names = [f"input[{i}]" for i in range(len(value))]
        return [self.embedder.token_ids(v, name) for v, name in zip(value, names, strict=True)], names  # type: ignore[arg-type]

    async def embeddings(self, body: EmbeddingRequest, http: Request) -> Response:
        self.frontend.check_model(body.model)
        if body.dimensions is not None:
            raise invalid_argument(
                "dimensions: this model does not support reduced (Matryoshka) dimensions; omit it",
                "dimensions",
            )
        try:
            pooling = PoolingParams(body.pooling_type, body.normalize)
        except InvalidField as exc:
            raise invalid_argument(str(exc), exc.field) from None
        inputs, names = self._inputs(body.input)
        gens = self.embedder.requests(
            inputs,
            pooling,
            field_names=names,
            request_id=http.headers.get("x-request-id"),
            request_id_field="x-request-id",
            priority=body.priority,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        embedded = await unless_disconnected(http, self.embedder.embed(gens))
        if embedded is None:  # the client left: its requests were aborted, their blocks freed
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        tokens = sum(e.prompt_tokens for e in embedded)
        data: list[dict[str, Any]] = [
            {"object": "embedding", "index": e.index, "embedding": encoded(e.values, body.encoding_format)}
            for e in embedded
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.frontend.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
