"""Embeddings, for every API that serves them (gRPC `Embed`, HTTP `/v1/embeddings`). No torch.

Each input becomes one pooling request (`GenerationRequest.pooling`): validated like any prompt
(`Frontend.validate`: its request id, priority, deadline, tenant and truncation), admitted,
routed and run on a data plane like a generation, but prompt-only: the data plane computes the
prompt, pools its final hidden states, frees its blocks and answers with the vector on the
request's finish. The inputs of one call run side by side; each counts as one request against
its tenant's limits, and the first that fails ends the call (the rest are aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.pooling_params import PoolingParams
from pagedserve.controlplane.errors import ServiceError, invalid_argument
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

MAX_EMBED_INPUTS = 256  # inputs in one call (as MAX_PROMPTS for completions)
_PROMPT_ONLY = {"max_tokens": 1, "temperature": 0.0}  # read only by admission: nothing is sampled
NO_POOLING_DATAPLANE = "no data plane here runs pooling requests (embeddings): upgrade the data planes"


@dataclass(frozen=True)
class Embedded:
    """One input's embedding and its token count."""

    index: int
    values: list[float]
    prompt_tokens: int


class Embedder:
    """Validates a call's inputs into pooling requests and runs them."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def check_count(self, num_inputs: int, field_name: str) -> None:
        if num_inputs < 1:
            raise invalid_argument(f"{field_name} must not be empty", field_name)
        if num_inputs > MAX_EMBED_INPUTS:
            raise invalid_argument(f"{field_name}: at most {MAX_EMBED_INPUTS} inputs per request", field_name)

    def token_ids(self, value: str | Sequence[int], field_name: str) -> list[int]:
        """An input's token ids: a text tokenized (no special tokens), or ids checked against
        the vocabulary; at most max_model_len of them (a pooling request generates nothing, so
        it may fill the context). Checked before truncation would apply: see `requests`."""
        if isinstance(value, str):
            ids = self.frontend.encode_text(value, field_name)
            if not ids:
                raise invalid_argument(f"{field_name}: tokenizes to no tokens", field_name)
            return ids
        return self.frontend.check_token_ids(value, field_name)

    def requests(
        self,
        inputs: Sequence[list[int]],
        pooling: PoolingParams,
        *,
        field_names: Sequence[str],
        request_id: str | None = None,
        request_id_field: str = "request_id",
        priority: int | None = None,
        deadline: float | None = None,
        truncate_prompt_tokens: int | None = None,
        field_prefix: str = "",
    ) -> list[GenerationRequest]:
        """One validated pooling request per input (`field_names[i]` names input i)."""
        gens = []
        for ids, name in zip(inputs, field_names, strict=True):
            gen = self.frontend.validate(
                ids,
                _PROMPT_ONLY,
                request_id=request_id,
                request_id_field=request_id_field,
                priority=priority,
                deadline=deadline,
                truncate_prompt_tokens=truncate_prompt_tokens,
                field_prefix=field_prefix,
            )
            context = self.frontend.max_model_len()
            if context is not None and gen.num_prompt_tokens > context:
                raise invalid_argument(
                    f"{name}: has {gen.num_prompt_tokens} tokens, but max_model_len is {context}", name
                )
            gens.append(dataclasses.replace(gen, pooling=pooling))
        return gens

    async def embed(self, gens: Sequence[GenerationRequest]) -> list[Embedded]:
        """Run every request side by side; their embeddings in order. Raises ServiceError (the
        first failure; the others are aborted, their blocks freed)."""
        infos = [c.info for c in self.frontend.dispatcher.healthy if c.info is not None]
        if infos and not any(i.pooling for i in infos):
            raise ServiceError("UNAVAILABLE", NO_POOLING_DATAPLANE)
        metrics = self.frontend.metrics
        metrics.embedding_requests.inc()
        tasks = [asyncio.create_task(self._one(gen)) for gen in gens]
        try:
            finishes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        out = []
        for index, (gen, finished) in enumerate(zip(gens, finishes, strict=True)):
            out.append(Embedded(index, list(finished.embedding), gen.num_prompt_tokens))
        metrics.embedding_inputs.inc(len(out))
        metrics.embedding_prompt_tokens.inc(sum(e.prompt_tokens for e in out))
        return out

    async def _one(self, gen: GenerationRequest) -> dataplane_pb2.RequestFinished:
        events = self.frontend.dispatcher.generate(gen)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, dataplane_pb2.RequestFinished):
                        if not event.embedding:  # aborted (its data plane drained or stopped)
                            raise ServiceError(
                                "UNAVAILABLE", "the data plane ended the request before pooling it"
                            )
                        return event
        except ServiceError as exc:
            self.frontend.record_failure(exc, gen.label)
            raise
        raise ServiceError("UNAVAILABLE", "the data plane ended the request before pooling it")
