"""Turns the last-position logits of each sampling request into its next token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.common.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # under the model's raw distribution, when asked for
    top_logprobs: list[tuple[int, float]] | None = None


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties on one row [V]."""
    vocab = logits.shape[-1]
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        picked = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
        logits[seen] = picked
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts.to(logits.dtype)
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits [N, V] (a new tensor), before penalties and
    sampling, so greedy rows see it too. Ids beyond the vocabulary (the control plane refuses
    them; the offline API may not) are ignored."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            if token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    logits = logits.clone()
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top_k, top_p and min_p row by row; returns probabilities [N, V]."""
    # logits: [N, V] float32
    n, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    top_k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long, device=logits.device
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand(n, vocab)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass *before* it already reaches top_p; the first token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> list[SampledToken]:
    """One token per row. Greedy rows take the argmax; the others draw with their own generator,
    so a seeded request gets the same tokens whatever else shares its batch.

    Each row's logit_bias, then its penalties, apply first (greedy rows included); logprobs
    stay those of the model's raw distribution. `histories[i]` = (prompt ids, output ids) of
    row i; needed only for rows with penalties.
    """
    # logits: [N, vocab]
    raw = logits
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, params)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        if histories is None:
            raise ValueError("penalties need the token histories")
        logits = logits.clone() if logits is raw else logits
        for i in penalised:
            logits[i] = apply_penalties(logits[i], params[i], *histories[i])
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, rows).float(), [params[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    out = [SampledToken(t) for t in tokens]
    logprob_rows = [i for i, p in enumerate(params) if p.needs_logprobs]
    if logprob_rows:
        rows = torch.tensor(logprob_rows, device=logits.device)
        logprobs = raw.index_select(0, rows).float().log_softmax(dim=-1)  # [M, V]
        for j, i in enumerate(logprob_rows):
            out[i].logprob = float(logprobs[j, tokens[i]])
            k = params[i].logprobs
            if k:
                values, ids = logprobs[j].topk(k)
                out[i].top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
    return out
