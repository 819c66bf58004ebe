"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' own log_softmax of its
logits at each next prompt token (tiny random Llama, CPU, fp32), with the prefix cache on and
off and with prompts longer than a prefill chunk; no KV block leaks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks.tiny_models import load_reference_model, make_tiny_model
from pagedserve.common.sampling_params import MAX_LOGPROBS, InvalidField
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.engine.llm import RequestOutput

K = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return path, load_reference_model(path)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 384) for _ in range(20)]
    return [
        shared + [rng.randrange(3, 384) for _ in range(7)],
        [rng.randrange(3, 384) for _ in range(45)],
        shared,  # whole blocks of the first prompt
        [rng.randrange(3, 384) for _ in range(2)],
    ]


@torch.inference_mode()
def reference(ref_model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at each prompt position [P, vocab], fp32."""
    logits = ref_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)


def assert_matches(ref_model: Any, prompt: list[int], out: RequestOutput) -> None:
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    logprobs = reference(ref_model, prompt)
    for p in range(1, len(prompt)):
        ours = out.prompt_logprobs[p]
        assert ours is not None
        row = logprobs[p - 1]
        expected = float(row[prompt[p]])
        assert abs(ours.logprob - expected) <= 1e-4, (p, ours.logprob, expected)
        assert ours.rank == int((row > row[prompt[p]]).sum()) + 1
        values, ids = row.topk(K)
        assert [t for t, _ in ours.top] == ids.tolist()
        assert [v for _, v in ours.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 4, "enable_prefix_caching": False},
        {"block_size": 4, "enable_prefix_caching": True},
        # Prompts longer than a prefill chunk, chunked beside other requests.
        {"block_size": 4, "enable_prefix_caching": True, "max_num_batched_tokens": 8, "max_num_seqs": 2},
        # A pool too small for all at once: requests are preempted (recomputed) and resumed.
        {
            "block_size": 4,
            "enable_prefix_caching": True,
            "max_num_batched_tokens": 9,
            "num_gpu_blocks_override": 16,
            "preemption_mode": "recompute",
            "watermark": 0.0,
            "max_tokens": 12,
        },
    ],
)
def test_prompt_logprobs_match_transformers(model: tuple[Path, Any], kwargs: dict[str, Any]) -> None:
    path, ref_model = model
    settings = {k: v for k, v in kwargs.items() if k != "max_tokens"}
    llm = LLM(str(path), max_model_len=128, **settings)
    items = prompts()
    max_tokens = kwargs.get("max_tokens", 2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    first = llm.generate(items, params, use_tqdm=False)
    # Again, after the first pass cached these prompts' blocks: every logprob still comes back.
    second = llm.generate(items, params, use_tqdm=False)
    for prompt, a, b in zip(items, first, second, strict=True):
        assert_matches(ref_model, prompt, a)
        assert_matches(ref_model, prompt, b)
        assert b.num_cached_tokens == 0
    engine = llm.engine
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    if "num_gpu_blocks_override" in kwargs:
        assert engine.scheduler.num_preemptions > 0
    if kwargs["enable_prefix_caching"]:
        assert engine.pool.num_cached_blocks > 0  # it still filled the cache for others
        plain = llm.generate(items[:1], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        assert plain[0].num_cached_tokens > 0 and plain[0].prompt_logprobs is None


def test_prompt_logprobs_zero_and_parallel_samples(model: tuple[Path, Any]) -> None:
    path, ref_model = model
    llm = LLM(str(path), max_model_len=128, block_size=4)
    prompt = prompts()[1]
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=3, prompt_logprobs=0)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert out.prompt_logprobs is not None
    logprobs = reference(ref_model, prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry is not None and entry.top == []
        assert abs(entry.logprob - float(logprobs[p - 1, prompt[p]])) <= 1e-4
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "2"])
def test_prompt_logprobs_bounds(value: object) -> None:
    with pytest.raises(InvalidField) as err:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert err.value.field == "prompt_logprobs"
