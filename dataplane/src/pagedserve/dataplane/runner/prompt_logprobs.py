"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-probability of each prompt token
given its prefix, read off the hidden states of the rows a step computes anyway.

Row p of a request (position p) predicts token p + 1; every prompt token is known up front, so
a chunk's last row predicts the next chunk's first token too. The results go onto the request
(`Request.prompt_logprobs`) as its chunks are computed. A request that asks for them takes no
cached prefix blocks (KVCacheManager), so each of its prompt positions is computed once here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.dataplane.request import PromptLogprob, Request

ROWS_PER_SLICE = 256
"""Prompt rows put through the LM head at once: bounds the [rows, vocab] fp32 work tensors."""


@dataclass(frozen=True)
class PromptRows:
    """A request's rows in the step's flattened batch that predict prompt tokens not yet
    scored: flattened rows `row` .. `row + count - 1`, positions `position` onwards."""

    request: Request
    row: int
    position: int
    count: int


def prompt_rows(request: Request, first_row: int, start: int, end: int) -> PromptRows | None:
    """The rows of `request`'s positions [start, end) (from flattened row `first_row`) that
    score prompt tokens it has no logprob for yet; None when none do or it asks for none.
    Positions already scored (a rerun step, a recompute after preemption) are not redone."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    low = max(start, len(request.prompt_logprobs))
    high = min(end, request.num_prompt_tokens - 1)  # the last prompt row predicts an output token
    if low >= high or low > len(request.prompt_logprobs):
        return None
    return PromptRows(request, first_row + low - start, low, high - low)


def add_prompt_logprobs(
    hidden: torch.Tensor, wanted: list[PromptRows], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Score the `wanted` rows of `hidden` [T, hidden]: log_softmax (fp32) of their logits at
    the next prompt token, its rank and the top-k, appended to each request's prompt_logprobs."""
    for item in wanted:
        request = item.request
        k = request.sampling_params.prompt_logprobs or 0
        for offset in range(0, item.count, ROWS_PER_SLICE):
            n = min(ROWS_PER_SLICE, item.count - offset)
            first = item.row + offset
            logprobs = compute_logits(hidden[first : first + n]).float().log_softmax(dim=-1)
            position = item.position + offset
            targets = torch.tensor(
                request.prompt_token_ids[position + 1 : position + 1 + n], device=logprobs.device
            )
            chosen = logprobs.gather(1, targets.unsqueeze(1))  # [n, 1]
            ranks = (logprobs > chosen).sum(dim=1) + 1
            values: list[list[float]] = [[] for _ in range(n)]
            ids: list[list[int]] = [[] for _ in range(n)]
            if k:
                top_values, top_ids = logprobs.topk(k, dim=1)
                values, ids = top_values.tolist(), top_ids.tolist()
            request.prompt_logprobs.extend(
                PromptLogprob(lp, rank, list(zip(ids[i], values[i], strict=True)))
                for i, (lp, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks.tolist(), strict=True))
            )
