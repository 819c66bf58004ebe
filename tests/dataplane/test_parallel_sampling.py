"""n > 1 and best_of: samples share the prompt's blocks by ref count; logprobs; salts; abort."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.dataplane import LLM, SamplingParams

PROMPT = list(range(10, 30))  # 20 tokens: one full block of 16 and a partial one


@pytest.fixture()
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), max_model_len=128, block_size=16, kv_cache_memory=2**20, max_num_seqs=8)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.has_unfinished_requests()


def test_samples_share_the_full_prompt_block(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    primary = engine.add_request(PROMPT, params, request_id="r")
    engine.step()  # the primary computes the prompt and samples its first token
    samples = engine.samples_of("r")
    assert [s.request_id for s in samples] == ["r", "r#1", "r#2"]
    assert primary.num_output_tokens == 1
    engine.step()  # siblings join: the full block is a prefix-cache hit, the partial one recomputed
    shared = primary.block_table[0]
    assert [s.block_table[0] for s in samples] == [shared] * 3
    assert engine.pool.blocks[shared].ref_cnt == 3
    assert [s.num_cached_tokens for s in samples[1:]] == [16, 16]
    assert len({s.block_table[1] for s in samples}) == 3  # partial blocks are private
    while engine.has_unfinished_requests():
        engine.step()
    assert all(s.num_output_tokens == 6 for s in samples)
    engine.release("r")
    assert_idle(llm)


def test_n_completions_are_seeded_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # different seeds per sample
    single = llm.generate([PROMPT], SamplingParams(max_tokens=8, seed=11, ignore_eos=True), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == single.token_ids  # sample 0 uses the request's own seed
    assert_idle(llm)


def test_best_of_keeps_the_most_likely_samples(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=4, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    scores = [c.cumulative_logprob for c in out.outputs]
    assert all(s is not None for s in scores)
    everyone = llm.generate(
        [PROMPT],
        SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    best_two = sorted((c.cumulative_logprob or 0.0 for c in everyone.outputs), reverse=True)[:2]
    assert scores == pytest.approx(best_two)
    assert_idle(llm)


def test_logprobs_per_token(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.logprobs is not None and c.top_logprobs is not None
    assert len(c.logprobs) == len(c.top_logprobs) == 4
    for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        assert top[0][0] == token  # greedy picks the most likely token
        assert top[0][1] == pytest.approx(lp)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert c.cumulative_logprob == pytest.approx(sum(c.logprobs))


def test_salted_requests_do_not_share(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], greedy, use_tqdm=False, cache_salt="tenant-a")
    other = llm.generate([PROMPT], greedy, use_tqdm=False, cache_salt="tenant-b")[0]
    same = llm.generate([PROMPT], greedy, use_tqdm=False, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 16
    assert other.token_ids == same.token_ids


def test_abort_a_parallel_request_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=50, seed=1, ignore_eos=True), request_id="x")
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=50, seed=1, ignore_eos=True), request_id="y")
    engine.step()  # x computes its prompt; y waits on the same (not yet cached) blocks
    engine.step()  # x's siblings join; y hits x's cached block
    xs = engine.samples_of("x")
    assert len(xs) == 4 and all(s.block_table for s in xs)
    assert engine.abort_request("x") is xs[0]
    assert [s.finish_reason for s in xs] == ["abort"] * 4
    assert all(not s.block_table for s in xs)
    assert engine.abort_request("y") is not None
    assert engine.abort_request("y") is None  # already gone
    assert_idle(llm)


def test_caching_on_and_off_give_the_same_tokens(tiny: Path) -> None:
    system = list(range(100, 150))
    prompts = [system + [200 + i] * (i % 5 + 1) for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = []
    for caching in (True, False):
        llm = LLM(str(tiny), max_model_len=128, block_size=4, max_num_seqs=2, enable_prefix_caching=caching)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.token_ids for o in outs])
        cached = sum(o.num_cached_tokens for o in outs)
        assert (cached > 0) == caching
    assert results[0] == results[1]
