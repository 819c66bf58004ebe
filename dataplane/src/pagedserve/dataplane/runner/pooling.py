"""Pooling (embedding) requests: their prompt's final hidden states pooled into one vector.

A pooling request (`Request.pooling`) is prompt-only: the runner samples nothing for it and the
scheduler ends it once its prompt is computed. Each step that computes some of its prompt
rows folds them into its running state here, so chunked prefill pools exactly what one
whole-prompt pass would: `mean` keeps an fp32 running sum, `cls` the first row, `last` waits
for the chunk that holds the final row. Positions already pooled (a rerun step, a recompute
after preemption) are not counted twice. Mean and cls requests take no cached prefix blocks
(KVCacheManager), so each of their rows is computed here once; a last-token request may, as
its final row is always computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.dataplane.request import Request


@dataclass
class PoolingState:
    """A pooling request's progress: the fp32 sum (mean) or first row (cls) of its rows
    [0, `upto`) pooled so far."""

    upto: int = 0
    pooled: torch.Tensor | None = None


@dataclass(frozen=True)
class PoolRows:
    """A pooling request's rows in the step's flattened batch: flattened row `row` holds
    position `start`, up to position `end` (exclusive)."""

    request: Request
    row: int
    start: int
    end: int


def pool_rows(request: Request, first_row: int, start: int, end: int) -> PoolRows | None:
    """The rows of `request`'s positions [start, end) (from flattened row `first_row`) when it
    is a pooling request, else None."""
    if request.pooling is None:
        return None
    return PoolRows(request, first_row, start, end)


def add_pooled(hidden: torch.Tensor, wanted: list[PoolRows]) -> None:
    """Fold each pooling request's rows of `hidden` [T, hidden] into its state; the request
    whose final prompt row is among them gets its `embedding`."""
    for item in wanted:
        request = item.request
        params = request.pooling
        assert params is not None
        state = request.pooling_state
        if not isinstance(state, PoolingState):
            state = request.pooling_state = PoolingState()
        if params.pooling_type != "last" and item.start > state.upto:
            raise RuntimeError(f"{request}: positions [{state.upto}, {item.start}) were never pooled")
        low = max(item.start, state.upto)
        rows = hidden[item.row + low - item.start : item.row + item.end - item.start].float()
        if params.pooling_type == "mean" and len(rows):
            total = rows.sum(dim=0)
            state.pooled = total if state.pooled is None else state.pooled + total
        elif params.pooling_type == "cls" and low == 0 and len(rows):
            state.pooled = rows[0].clone()
        state.upto = max(state.upto, item.end)
        if item.end < request.num_prompt_tokens:
            continue
        if params.pooling_type == "last":
            vector = hidden[item.row + item.end - item.start - 1].float()
        elif params.pooling_type == "mean":
            assert state.pooled is not None
            vector = state.pooled / request.num_prompt_tokens
        else:
            assert state.pooled is not None
            vector = state.pooled
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        request.embedding = vector.tolist()
