"""Speculative decoding in the engine (tiny random Llama, CPU, fp32): greedy output is token
for token the output without it, with prefix caching, chunked prefill, preemption, n > 1 and
logprobs; no KV block leaks; drafts are really accepted."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.engine.outputs import StepResult

# Every draft verified (not only those the cost model finds worth it): the tests check
# verification and rollback, which the adaptive policy would otherwise often spare.
NGRAM = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
)


def prompts() -> list[list[int]]:
    """Prompts that repeat spans of themselves (as code edits and quotes do), and plain ones."""
    rng = random.Random(3)
    out = []
    for i in range(10):
        span = [rng.randrange(3, 384) for _ in range(rng.randint(4, 12))]
        noise = [rng.randrange(3, 384) for _ in range(rng.randint(0, 10))]
        out.append(span * 3 + noise + span[: 2 + i % 3] if i % 3 else noise + span)
    return out


class OracleDrafter:
    """Proposes the tokens a run without drafts produced (`truth`: prompt -> output), with
    every `wrong`-th proposed token replaced: a random model rarely repeats itself, and this
    makes both acceptance and rejection happen at known places."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], wrong: int) -> None:
        self.truth = truth
        self.wrong = wrong
        self.calls = 0

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        for prompt, output in self.truth.items():
            if (
                tuple(tokens[: len(prompt)]) == prompt
                and list(tokens[len(prompt) :]) == output[: len(tokens) - len(prompt)]
            ):
                draft = output[len(tokens) - len(prompt) : len(tokens) - len(prompt) + k]
                self.calls += 1
                if self.calls % self.wrong == 0 and draft:
                    draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 384
                return draft
        return []

    def finished(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        pass


def generate(
    path: Path, spec: str | None, params: SamplingParams, oracle: list[Any] | None = None, **kwargs: Any
) -> tuple[list[Any], LLM]:
    """`prompts()` generated with `spec`; with `oracle` (a run's outputs) its drafter drafts them."""
    kwargs.setdefault("kv_cache_memory", 2**26)  # (small pools start fast)
    llm = LLM(str(path), max_model_len=256, speculative_config=spec, swap_space=0.05, **kwargs)
    if oracle is not None:
        truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts(), oracle, strict=True)}
        llm.engine.speculator.drafter = OracleDrafter(truth, wrong=3)  # type: ignore[union-attr]
    return llm.generate(prompts(), params, use_tqdm=False), llm


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 16},
        {"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 24, "num_gpu_blocks_override": 40},
        {"block_size": 8, "enable_prefix_caching": False, "max_num_seqs": 1},
    ],
    ids=["plain", "small-pool", "one-stream"],
)
def test_greedy_output_is_unchanged_by_speculation(tiny: Path, kwargs: dict[str, Any]) -> None:
    spec = NGRAM
    plain, _ = generate(tiny, None, GREEDY, **kwargs)
    fast, llm = generate(tiny, spec, GREEDY, oracle=plain, **kwargs)
    for i, (a, b) in enumerate(zip(plain, fast, strict=True)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i}"
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4), f"prompt {i}"
        tops_a, tops_b = a.outputs[0].top_logprobs, b.outputs[0].top_logprobs
        assert [[t for t, _ in row] for row in tops_b] == [[t for t, _ in row] for row in tops_a]
    stats = llm.engine.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted_tokens > 0 and stats.drafted_tokens >= stats.accepted_tokens
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    if kwargs.get("num_gpu_blocks_override"):
        assert llm.engine.stats().num_preemptions > 0


def test_n_samples_and_a_stop_inside_an_accepted_run(tiny: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=2)
    plain, _ = generate(tiny, None, params)
    fast, llm = generate(tiny, NGRAM, params, oracle=plain)
    assert [[o.token_ids for o in r.outputs] for r in fast] == [
        [o.token_ids for o in r.outputs] for r in plain
    ]
    # A stop id that shows up mid-output ends every request exactly where it would without drafts.
    stops = [r.outputs[0].token_ids[7] for r in plain]
    for prompt, stop, want in zip(prompts(), stops, plain, strict=True):
        p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
        got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        cut = want.outputs[0].token_ids.index(stop) + 1
        assert got.token_ids == want.outputs[0].token_ids[:cut]
        assert got.finish_reason == "stop"
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_seeded_sampling_repeats_and_opting_out_drafts_nothing(tiny: Path) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11)
    first, llm = generate(tiny, NGRAM, params)
    again = llm.generate(prompts(), params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in first]
    before = llm.engine.speculator.stats.drafted_tokens  # type: ignore[union-attr]
    llm.generate(prompts(), SamplingParams(max_tokens=24, temperature=0.0, speculative=False), use_tqdm=False)
    assert llm.engine.speculator.stats.drafted_tokens == before  # type: ignore[union-attr]


def test_a_step_returns_every_token_of_an_accepted_run(tiny: Path) -> None:
    llm = LLM(str(tiny), max_model_len=256, speculative_config=NGRAM, kv_cache_memory=2**26, swap_space=0)
    engine = llm.engine
    prompt = [9, 10, 11, 12, 13] * 6
    engine.add_request(
        prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), request_id="r"
    )
    results: list[StepResult] = []
    while engine.has_unfinished_requests():
        results.append(engine.step())
    request = results[-1].finished[0]
    streamed = [t for r in results for t in r.new_tokens.get("r", [])]
    assert streamed == request.output_token_ids
    assert len(results) < 41  # some step took more than one token
    assert request.num_spec_accepted == sum(
        len(r.new_tokens.get("r", [])) - 1 for r in results if r.new_tokens.get("r")
    )


def test_seeded_sampling_is_token_for_token_the_run_without_drafts(tiny: Path) -> None:
    """A seeded draw depends only on the request's seed value and the output position, and a drafted position
    samples from the distribution a plain step would: so with the same seed the text is the
    same, drafts accepted or rejected. For every seed alike, so the distributions over seeds
    (what an unseeded request draws from) are the same too."""
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, logprobs=0)
    plain, _ = generate(tiny, None, params)
    fast, llm = generate(tiny, NGRAM, params, oracle=plain)
    for a, b in zip(plain, fast, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
    stats = llm.engine.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted_tokens > 0 and stats.drafted_tokens > stats.accepted_tokens
