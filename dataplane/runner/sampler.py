"""Turns the last-position logits of each sampling request into its next token."""

from __future__ import annotations

import torch

from dataplane.sampling_params import SamplingParams


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
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others draw with their own generator,
    so a seeded request gets the same tokens whatever else shares its batch."""
    # logits: [N, vocab]
    greedy_tokens = logits.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return list(greedy_tokens)
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs = _filtered_probs(logits.index_select(0, rows).float(), [params[i] for i in sampled_rows])
    tokens = list(greedy_tokens)
    for j, i in enumerate(sampled_rows):
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return tokens
