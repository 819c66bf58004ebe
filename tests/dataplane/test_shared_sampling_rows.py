"""Samples that read the same logits row share the work over the vocabulary, and their outputs
stay exactly those of computing every sample alone.

The sampler: one log-softmax per distinct raw row, one row of filtered probabilities per
distinct (row, filter), one top-k per (row, k), counted by `SamplerWork`, with tokens and
logprobs equal bit for bit to the unshared computation (`unshared_sample`, the sampler as it
was). The engine: the n samples of one prompt draw their first tokens from the primary's
logits row in the primary's step, so a sample that ends there (max_tokens 1) never computes
its prompt, and the outputs equal those of samples that each compute their prompt first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane import LLM
from pagedserve.dataplane.engine import first_tokens
from pagedserve.dataplane.engine.llm_engine import LLMEngine
from pagedserve.dataplane.runner.sampler import (
    SampledToken,
    SamplerWork,
    _filtered_probs,
    apply_logit_bias,
    apply_penalties,
    sample,
)
from pagedserve.dataplane.scheduler import Request

VOCAB = 4096


def unshared_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> list[SampledToken]:
    """The sampler before rows were shared: every row's work done for that row alone."""
    raw = logits
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, params)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        assert histories is not None
        logits = logits.clone() if logits is raw else logits
        for i in penalised:
            logits[i] = apply_penalties(logits[i], params[i], *histories[i])
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        probs = _filtered_probs(logits.index_select(0, rows).float(), [params[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    out = [SampledToken(t) for t in tokens]
    logprob_rows = [i for i, p in enumerate(params) if p.needs_logprobs]
    if logprob_rows:
        rows = torch.tensor(logprob_rows)
        logprobs = raw.index_select(0, rows).float().log_softmax(dim=-1)
        for j, i in enumerate(logprob_rows):
            out[i].logprob = float(logprobs[j, tokens[i]])
            k = params[i].logprobs
            if k:
                values, ids = logprobs[j].topk(k)
                out[i].top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
    return out


def gens(params: list[SamplingParams]) -> list[torch.Generator | None]:
    out: list[torch.Generator | None] = []
    for i, p in enumerate(params):
        g = None
        if not p.greedy:
            g = torch.Generator()
            g.manual_seed(1000 + i)
        out.append(g)
    return out


def as_tuples(tokens: list[SampledToken]) -> list[tuple[int, float | None, object]]:
    return [(t.token_id, t.logprob, t.top_logprobs) for t in tokens]


def logits_rows(num_rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=g) * 3


def test_samples_of_one_row_share_its_log_softmax_and_top_k() -> None:
    rows = logits_rows(3)
    # 128 samples of row 1 (an n=128 request's first tokens), plus rows 0 and 2 once each.
    params = [SamplingParams(temperature=1.0, logprobs=20, seed=i) for i in range(128)]
    params += [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=0),
    ]
    reads = [1] * 128 + [0, 2]
    work = SamplerWork()
    shared = sample(rows, params, gens(params), rows=reads, work=work)
    alone = unshared_sample(rows.index_select(0, torch.tensor(reads)), params, gens(params))
    assert as_tuples(shared) == as_tuples(alone)
    assert len({t.token_id for t in shared[:128]}) > 1  # the samples really draw apart
    assert work.samples == 130
    assert work.log_softmax_rows == 3  # one per distinct row, not 130
    assert work.top_logprob_rows == 2  # row 1 with k=20 once, row 0 with k=5; k=0 picks none
    assert work.prob_rows == 2  # row 1 at temperature 1, row 2 with its own filter


def test_equal_rows_at_different_indices_are_found_by_content() -> None:
    """Siblings that compute the same prompt in one step give bit-equal rows: shared too."""
    row = logits_rows(1, seed=1)
    rows = row.expand(64, VOCAB).contiguous()
    params = [SamplingParams(temperature=1.0, logprobs=3, seed=i) for i in range(64)]
    work = SamplerWork()
    shared = sample(rows, params, gens(params), work=work)
    assert as_tuples(shared) == as_tuples(unshared_sample(rows, params, gens(params)))
    assert (work.log_softmax_rows, work.prob_rows, work.top_logprob_rows) == (1, 1, 1)


def test_rows_differing_in_one_bit_are_not_shared() -> None:
    base = logits_rows(1, seed=2)[0]
    near = base.clone()
    near[1] = torch.nextafter(near[1], torch.tensor(float("inf")))  # off the fingerprint's points
    signed = base.clone()
    signed[0] = 0.0
    negative = signed.clone()
    negative[0] = -0.0  # equal as numbers, not as bits
    rows = torch.stack([base, near, signed, negative])
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 4
    work = SamplerWork()
    shared = sample(rows, params, gens(params), work=work)
    assert as_tuples(shared) == as_tuples(unshared_sample(rows, params, gens(params)))
    assert work.log_softmax_rows == 4


def test_bias_penalties_and_filters_keep_their_own_rows() -> None:
    rows = logits_rows(1, seed=3)
    histories = [([5, 6, 7], [8, 8])] * 8
    params = [
        SamplingParams(temperature=1.0, seed=1, logprobs=4),
        SamplingParams(temperature=1.0, seed=2, logprobs=4),
        SamplingParams(temperature=1.0, seed=3, top_k=5, logprobs=4),
        SamplingParams(temperature=0.5, seed=4, min_p=0.1),
        SamplingParams(temperature=1.0, seed=5, logit_bias=((9, 50.0),), logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    work = SamplerWork()
    shared = sample(rows, params, gens(params), histories, rows=[0] * 8, work=work)
    alone = unshared_sample(rows.expand(8, VOCAB), params, gens(params), histories)
    assert as_tuples(shared) == as_tuples(alone)
    assert shared[4].token_id == 9  # the bias applies to its own sample only
    assert work.log_softmax_rows == 1  # logprobs read the raw row: one for all
    # probabilities: plain (samples 0, 1 and the biased row's filter differ by row), top_k=5,
    # temperature 0.5 + min_p, the biased row, the penalised row
    assert work.prob_rows == 5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama-vocab"), vocab_size=VOCAB)


def new_llm(model_path: Path) -> LLM:
    # The panel kernels: batch-invariant, as the engine needs for bit-equal rows (docs/kernels.md).
    return LLM(
        str(model_path),
        max_model_len=256,
        block_size=16,
        kv_cache_memory=8 * 2**20,
        max_num_seqs=64,
        cpu_linear="panel",
    )


def outputs(
    llm: LLM, prompt: list[int], params: SamplingParams
) -> list[tuple[list[int], object, object, object]]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return [(c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason) for c in out.outputs]


def no_riders(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine as it was: every sample computes its prompt, then samples its first token."""
    monkeypatch.setattr(engine.groups.first_tokens, "riders", lambda out, draws: {})


def draws_per_step(monkeypatch: pytest.MonkeyPatch, draws: int) -> None:
    monkeypatch.setattr(first_tokens, "FIRST_TOKEN_DRAW_ELEMENTS", draws * VOCAB)


@pytest.mark.parametrize("draws", [None, 5])  # the default bound (256 draws at this vocabulary), 5 a step
@pytest.mark.parametrize("prompt_len", [20, 32, 5])  # a partial last block, full blocks, no full block
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=24, logprobs=20, max_tokens=1, temperature=1.0, seed=7),
        SamplingParams(n=6, best_of=9, logprobs=3, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(
            n=5, max_tokens=5, temperature=1.0, top_k=40, seed=1, repetition_penalty=1.3, ignore_eos=True
        ),
    ],
    ids=["n24-first-token", "best-of-continuing", "penalties-continuing"],
)
def test_engine_outputs_equal_the_unshared_engine(
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prompt_len: int,
    params: SamplingParams,
    draws: int | None,
) -> None:
    if draws is not None:
        draws_per_step(monkeypatch, draws)
    prompt = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(prompt_len)]
    shared = new_llm(model_path)
    got = outputs(shared, prompt, params)
    unshared = new_llm(model_path)
    no_riders(unshared.engine, monkeypatch)
    assert got == outputs(unshared, prompt, params)
    assert len({tuple(o[0]) for o in got}) > 1  # different seeds per sample
    for llm in (shared, unshared):
        llm.engine.check_integrity()
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_first_tokens_cost_one_row_and_no_forward(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n=128 x logprobs=20 x max_tokens=1: one step (with a draw budget for all 128), the
    primary's prompt alone in the forward, one log-softmax and one top-k for the 128 samples,
    each with its own draw."""
    monkeypatch.setattr(first_tokens, "FIRST_TOKEN_DRAW_ELEMENTS", 128 * VOCAB)
    llm = new_llm(model_path)
    engine = llm.engine
    guard = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, logprobs=1), "guard")
    engine.step()
    prompt = list(range(10, 30))
    engine.add_request(prompt, SamplingParams(n=128, logprobs=20, max_tokens=1, seed=4), "heavy")
    before = SamplerWork(**vars(engine.runner.sample_work))
    result = engine.step()
    work = engine.runner.sample_work
    samples = engine.samples_of("heavy")
    assert result.num_batched_tokens == len(prompt) + 1  # the primary's prompt and the guard's token
    assert set(result.new_tokens) == {"guard"} | {s.request_id for s in samples}
    assert {r.request_id for r in result.finished} == {s.request_id for s in samples}
    assert work.samples - before.samples == 129
    assert work.log_softmax_rows - before.log_softmax_rows == 2  # the guard's row and the prompt's row
    assert work.top_logprob_rows - before.top_logprob_rows == 2
    assert work.prob_rows - before.prob_rows == 1  # the guard is greedy
    assert all(s.finish_reason == "length" and s.num_output_tokens == 1 for s in samples)
    assert all(s.output_top_logprobs == samples[0].output_top_logprobs for s in samples)
    assert len({s.output_token_ids[0] for s in samples}) > 1
    assert not engine.scheduler.has_unfinished() or engine.scheduler.num_running == 1  # the guard alone
    engine.release("heavy")
    engine.abort_request("guard")
    assert guard.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_continuing_samples_compute_their_prompt_then_decode(model_path: Path) -> None:
    engine = new_llm(model_path).engine
    prompt = list(range(10, 30))  # one full block (a prefix-cache hit) and 4 tokens
    engine.add_request(prompt, SamplingParams(n=3, max_tokens=4, seed=2, ignore_eos=True), "r")
    engine.step()
    samples = engine.samples_of("r")
    siblings: list[Request] = samples[1:]
    assert all(s.num_output_tokens == 1 and s.first_chunk_end == len(prompt) for s in siblings)
    joined = engine.step()  # siblings join: their prompt's last 4 tokens, no token drawn
    assert joined.num_batched_tokens == 2 * 4 + 1  # and the primary's decode
    assert set(joined.new_tokens) == {"r"}
    assert all(s.num_output_tokens == 1 and s.first_chunk_end is None for s in siblings)
    assert all(s.num_computed_tokens == len(prompt) for s in siblings)
    decoded = engine.step()  # now they decode their first token and draw their second
    assert decoded.num_batched_tokens == 3
    assert all(s.num_output_tokens == 2 for s in siblings)
    while engine.has_unfinished_requests():
        engine.step()
    engine.release("r")
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_abort_after_the_first_tokens(model_path: Path) -> None:
    engine = new_llm(model_path).engine
    engine.add_request(list(range(10, 40)), SamplingParams(n=8, max_tokens=20, seed=1, ignore_eos=True), "x")
    engine.step()
    samples = engine.samples_of("x")
    assert all(s.num_output_tokens == 1 for s in samples)
    assert engine.abort_sample("x", 3) is samples[3]
    engine.step()
    assert engine.abort_request("x") is samples[0]
    assert all(s.finish_reason == "abort" for s in samples)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_first_token_that_stops_ends_the_sample(model_path: Path) -> None:
    """EOS or a stop token drawn as a first token: the sample finishes in the primary's step."""
    llm = new_llm(model_path)
    greedy_first = llm.generate(
        [list(range(10, 30))], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
    )
    stop = greedy_first[0].token_ids[0]
    engine = llm.engine
    engine.add_request(
        list(range(10, 30)),
        SamplingParams(n=4, max_tokens=10, temperature=0.0, stop_token_ids=(stop,)),
        "s",
        cache_salt="fresh",  # the prompt computed again, not read from the greedy run's blocks
    )
    result = engine.step()
    assert len(result.finished) == 4 and result.num_batched_tokens == 20
    assert all(s.finish_reason == "stop" for s in engine.samples_of("s"))
    assert not engine.has_unfinished_requests()


def test_first_token_draws_are_bounded_per_step(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the per-step bound, samples draw their first tokens in the next steps, from the
    primary's kept row: one log-softmax a step for them, no forward of their prompt, and the
    tokens of drawing them all at once."""
    draws_per_step(monkeypatch, 5)
    llm = new_llm(model_path)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), "guard")
    engine.step()
    prompt = list(range(10, 30))
    params = SamplingParams(n=24, logprobs=20, max_tokens=1, seed=4)
    engine.add_request(prompt, params, "heavy")
    heavy = {s.request_id for s in engine.samples_of("heavy")}
    per_step: list[tuple[int, int, int]] = []
    while any(not s.status.finished for s in engine.samples_of("heavy")):
        before = engine.runner.sample_work.log_softmax_rows
        result = engine.step()
        drawn = len(heavy & set(result.new_tokens))
        per_step.append(
            (drawn, result.num_batched_tokens, engine.runner.sample_work.log_softmax_rows - before)
        )
    # the primary and 5 riders with its prompt, then 5 draws a step beside the guard's decode
    assert per_step == [(6, len(prompt) + 1, 1), (5, 1, 1), (5, 1, 1), (5, 1, 1), (3, 1, 1)]
    assert engine.scheduler.num_running == 1  # the guard: no sample ever joined the batch
    got = [(s.output_token_ids, s.output_logprobs, s.output_top_logprobs) for s in engine.samples_of("heavy")]
    engine.release("heavy")
    engine.abort_request("guard")
    at_once = LLM(
        str(model_path), max_model_len=256, block_size=16, kv_cache_memory=8 * 2**20, cpu_linear="panel"
    )
    draws_per_step(monkeypatch, 1000)
    out = at_once.generate([prompt], params, use_tqdm=False)[0]
    assert got == [(c.token_ids, c.logprobs, c.top_logprobs) for c in out.outputs]
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_draws_go_on_in_steps_without_a_forward(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a request whose primary ended with its first token still draws its samples' first
    tokens in the next steps, though nothing is scheduled; offline generate sees progress."""
    draws_per_step(monkeypatch, 3)
    llm = new_llm(model_path)
    engine = llm.engine
    engine.add_request(list(range(10, 30)), SamplingParams(n=10, max_tokens=1, seed=2), "r")
    results = [engine.step()]
    while engine.has_unfinished_requests():
        results.append(engine.step())
    assert [len(r.new_tokens) for r in results] == [4, 3, 3]
    assert [r.num_batched_tokens for r in results] == [20, 0, 0]
    assert sum(len(r.finished) for r in results) == 10
    engine.release("r")
    out = llm.generate([list(range(10, 30))], SamplingParams(n=10, max_tokens=1, seed=2), use_tqdm=False)[0]
    assert len(out.outputs) == 10
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_abort_while_samples_wait_to_draw(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draws_per_step(monkeypatch, 2)
    engine = new_llm(model_path).engine
    engine.add_request(list(range(10, 30)), SamplingParams(n=8, max_tokens=5, seed=2, ignore_eos=True), "r")
    engine.step()
    samples = engine.samples_of("r")
    assert [s.num_output_tokens for s in samples] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert engine.abort_sample("r", 5) is samples[5]  # waiting to draw
    engine.step()
    assert samples[5].num_output_tokens == 0 and samples[5].finish_reason == "abort"
    assert engine.abort_request("r") is samples[0]
    assert all(s.finish_reason == "abort" for s in samples)
    assert not engine.has_unfinished_requests()
    engine.step()  # nothing left to draw or run
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_older_requests_draw_first(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is over all requests: a newer request's samples wait for an older one's."""
    draws_per_step(monkeypatch, 5)
    engine = new_llm(model_path).engine
    engine.add_request(list(range(10, 30)), SamplingParams(n=12, max_tokens=1, seed=1), "a")
    a = {s.request_id for s in engine.samples_of("a")}
    per_step = [(len(a & set(engine.step().new_tokens)), 0)]
    engine.add_request(list(range(40, 60)), SamplingParams(n=12, max_tokens=1, seed=2), "b")
    b = {s.request_id for s in engine.samples_of("b")}
    while engine.has_unfinished_requests():
        new = set(engine.step().new_tokens)
        per_step.append((len(a & new), len(b & new)))
    # a: its primary and 5 riders, 5, then its last one; b: its primary (no riders: a's 6 wait)
    assert per_step == [(6, 0), (5, 1), (1, 4), (0, 5), (0, 2)]
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
