"""Turns the last-position logits of each sampling request into its next token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedserve.common.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # under the model's raw distribution, when asked for
    top_logprobs: list[tuple[int, float]] | None = None
    # Speculative decoding: the drafted tokens the step accepted before this one, in order.
    accepted: list[SampledToken] = field(default_factory=list)


def accept_drafts(drafts: Sequence[int], row_tokens: list[SampledToken]) -> SampledToken:
    """Verify `drafts` against the tokens sampled at each of their rows (`row_tokens[j]` from
    the distribution after drafts[:j], one more row than drafts): the longest prefix of drafts
    equal to the sampled tokens is accepted, and the sampled token after it ends the run.

    For a greedy sample this keeps the argmax chain exactly. For a drawn one it is the
    rejection sampling of speculative decoding (Leviathan et al., 2023) with a drafter whose
    distribution is a point mass: draft d at a row is accepted with probability p(d), and a
    rejection leaves the token drawn from p conditioned on not being d, the normalised
    residual max(0, p - q). So every emitted token follows the target distribution."""
    m = 0
    while m < len(drafts) and row_tokens[m].token_id == drafts[m]:
        m += 1
    last = row_tokens[m]
    last.accepted = row_tokens[:m]
    return last


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


def masked_ids(params: SamplingParams, num_output: int, eos_token_id: int | None) -> list[int]:
    """The ids min_tokens masks for a sample that generated `num_output` tokens: its stop
    token ids and EOS (unless ignored) until it generated `min_tokens`."""
    if num_output >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        ids.append(eos_token_id)
    return ids


def bad_word_ids(params: SamplingParams, output_ids: Sequence[int]) -> list[int]:
    """The ids bad words mask after `output_ids`: each one-token word's, and each longer
    word's last token when the output ends with the rest of the word (vLLM's semantics)."""
    ids = []
    for word in params.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix == 0 or (len(output_ids) >= prefix and tuple(output_ids[-prefix:]) == word[:-1]):
            ids.append(word[-1])
    return ids


def apply_masks(
    logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int], eos_token_id: int | None
) -> torch.Tensor:
    """One row [V] with the tokens `params` forbid now set to -inf, in place: all but
    `allowed_token_ids`, then what min_tokens (`masked_ids`) and bad words (`bad_word_ids`)
    mask. A mask that would leave no token at all (e.g. only EOS allowed before min_tokens)
    is skipped, so there is always a token to pick."""
    vocab = logits.shape[-1]
    if params.allowed_token_ids is not None:
        keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long)
        masked = torch.full_like(logits, float("-inf"))
        if len(keep):
            keep = keep.to(logits.device)
            masked[keep] = logits[keep]
        if bool(torch.isfinite(masked).any()):
            logits.copy_(masked)
    forbidden = masked_ids(params, len(output_ids), eos_token_id) + bad_word_ids(params, output_ids)
    ids = [t for t in forbidden if t < vocab]
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        kept = logits.index_fill(0, index, float("-inf"))
        if bool(torch.isfinite(kept).any()):
            logits.copy_(kept)
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


@dataclass
class SamplerWork:
    """What the sampler computed over the whole vocabulary, counted across calls: rows of
    probabilities (temperature, top-k/p, min-p: a sort each), rows of log-softmax, and top-k
    picks of logprobs. One per distinct logits row (and filter, or k), not one per sample:
    samples that read the same row share them (`sample`)."""

    samples: int = 0
    prob_rows: int = 0
    log_softmax_rows: int = 0
    top_logprob_rows: int = 0


# Positions of a row read to tell rows apart before comparing them whole (a cheap first key).
_FINGERPRINT_POINTS = 64
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _distinct_rows(logits: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """For each of `rows` (indices into logits [R, V]), the first of `rows` holding the same
    row bit for bit (itself when none before it does): rows with equal bits give equal results
    in every per-row computation, so one stands for all of them."""
    used = sorted(set(rows))
    if len(used) <= 1:
        return list(rows)
    vocab = logits.shape[-1]
    step = max(1, vocab // _FINGERPRINT_POINTS)
    bits = logits.view(_BITS[logits.element_size()])  # -0.0 and 0.0 differ, a NaN equals itself
    picked = bits[:, ::step].index_select(0, torch.tensor(used, device=logits.device)).cpu()
    keys = {row: picked[j].numpy().tobytes() for j, row in enumerate(used)}
    canonical: dict[int, int] = {}
    firsts: dict[bytes, list[int]] = {}
    for row in used:
        same = firsts.setdefault(keys[row], [])
        for first in same:
            if torch.equal(bits[first], bits[row]):
                canonical[row] = first
                break
        else:
            same.append(row)
            canonical[row] = row
    return [canonical[r] for r in rows]


def _filter_key(p: SamplingParams, vocab: int) -> tuple[float, int, float, float]:
    return (p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    rows: Sequence[int] | None = None,
    work: SamplerWork | None = None,
    eos_token_ids: Sequence[int | None] | None = None,
) -> list[SampledToken]:
    """One token per sample. Greedy samples take the argmax; the others draw with their own
    generator, so a seeded request gets the same tokens whatever else shares its batch.

    `rows[i]` is the row of `logits` [R, V] sample i reads (default: row i; several samples
    may read one row, e.g. the n samples of one prompt drawing their first tokens). Each
    sample's logit_bias, then its masks (`apply_masks`), then its penalties, apply first
    (greedy samples included); logprobs stay those of the model's raw distribution.
    `histories[i]` = (prompt ids, output ids) of sample i; needed only for samples with
    penalties, min_tokens or bad words. `eos_token_ids[i]`: sample i's EOS, which min_tokens masks.

    The work over the whole vocabulary is done once per distinct row (bit for bit, found by
    content, so equal rows computed twice are shared too): the filtered probabilities once per
    (row, temperature, top-k, top-p, min-p), the log-softmax once per raw row, its top-k once
    per (raw row, k). Each sample then only draws from its row with its own generator (or
    takes the argmax) and reads its logprobs, so the results are those of computing every
    sample alone. `work` counts what was computed.
    """
    # logits: [R, vocab]
    n = len(params)
    rows = list(range(n)) if rows is None else list(rows)
    if len(rows) != n or len(generators) != n:
        raise ValueError(f"{n} samples need {n} rows and generators, got {len(rows)} and {len(generators)}")
    raw = logits
    eos: list[int | None] = list(eos_token_ids) if eos_token_ids is not None else [None] * n
    logits, sample_rows = _adjusted(raw, params, rows, histories, eos)
    if work is not None:
        work.samples += n
    tokens = _greedy_tokens(logits, params, sample_rows)
    _draw_tokens(logits, params, generators, sample_rows, tokens, work)
    out = [SampledToken(t) for t in tokens]
    _add_logprobs(raw, params, rows, out, work)
    return out


def _adjusted(
    raw: torch.Tensor,
    params: list[SamplingParams],
    rows: list[int],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
    eos: list[int | None],
) -> tuple[torch.Tensor, list[int]]:
    """Samples with a bias, masks or penalties read a row of their own: their raw row,
    adjusted, appended after the raw rows. Returns the rows and each sample's row among them."""
    adjusted = [i for i, p in enumerate(params) if p.logit_bias or p.has_penalties or p.has_masks]
    if not adjusted:
        return raw, rows
    if histories is None and any(params[i].needs_history for i in adjusted):
        raise ValueError("penalties, min_tokens and bad words need the token histories")
    own = raw.index_select(0, torch.tensor([rows[i] for i in adjusted], device=raw.device))
    own_params = [params[i] for i in adjusted]
    if any(p.logit_bias for p in own_params):
        own = apply_logit_bias(own, own_params)
    for j, i in enumerate(adjusted):
        if params[i].has_masks:
            apply_masks(own[j], params[i], histories[i][1] if histories is not None else (), eos[i])
        if params[i].has_penalties:
            assert histories is not None
            own[j] = apply_penalties(own[j], params[i], *histories[i])
    sample_rows = list(rows)
    for j, i in enumerate(adjusted):
        sample_rows[i] = raw.shape[0] + j
    return torch.cat([raw, own]), sample_rows


def _greedy_tokens(logits: torch.Tensor, params: list[SamplingParams], sample_rows: list[int]) -> list[int]:
    """The argmax of each greedy sample's row (0 for the others, drawn later)."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        best: list[int] = logits.argmax(dim=-1).tolist()  # every row: at most the samples' rows, once each
        for i in greedy:
            tokens[i] = best[sample_rows[i]]
    return tokens


def _draw_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    sample_rows: list[int],
    tokens: list[int],
    work: SamplerWork | None,
) -> None:
    """The non-greedy samples' tokens, into `tokens`: one row of probabilities per distinct
    (row, filter), a draw per sample with its own generator."""
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return
    vocab = logits.shape[-1]
    sample_rows = _distinct_rows(logits, sample_rows)  # (greedy samples need no sharing: one argmax)
    groups: dict[tuple[int, tuple[float, int, float, float]], int] = {}
    for i in drawn:
        groups.setdefault((sample_rows[i], _filter_key(params[i], vocab)), i)
    firsts = list(groups.values())
    index = torch.tensor([sample_rows[i] for i in firsts], device=logits.device)
    probs = _filtered_probs(logits.index_select(0, index).float(), [params[i] for i in firsts])
    if work is not None:
        work.prob_rows += len(firsts)
    slot = {key: j for j, key in enumerate(groups)}
    for i in drawn:
        j = slot[(sample_rows[i], _filter_key(params[i], vocab))]
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())


def _add_logprobs(
    raw: torch.Tensor,
    params: list[SamplingParams],
    rows: list[int],
    out: list[SampledToken],
    work: SamplerWork | None,
) -> None:
    """Logprobs, under the raw distribution: one log-softmax per distinct raw row, one top-k
    per (raw row, k)."""
    wanted = [i for i, p in enumerate(params) if p.needs_logprobs]
    if not wanted:
        return
    raw_rows = _distinct_rows(raw, [rows[i] for i in wanted])
    distinct = sorted(set(raw_rows))
    logprobs = raw.index_select(0, torch.tensor(distinct, device=raw.device)).float().log_softmax(dim=-1)
    at = {row: j for j, row in enumerate(distinct)}
    tops: dict[tuple[int, int], list[tuple[int, float]]] = {}
    if work is not None:
        work.log_softmax_rows += len(distinct)
    for i, row in zip(wanted, raw_rows, strict=True):
        j = at[row]
        out[i].logprob = float(logprobs[j, out[i].token_id])
        k = params[i].logprobs
        if k:
            top = tops.get((j, k))
            if top is None:
                values, ids = logprobs[j].topk(k)
                top = tops[(j, k)] = list(zip(ids.tolist(), values.tolist(), strict=True))
                if work is not None:
                    work.top_logprob_rows += 1
            out[i].top_logprobs = list(top)
