"""Pooling (embedding) requests equal the same pooling over transformers' final hidden states
(tiny random Llama, CPU, fp32): last token, mean and cls, normalised or not, with the prefix
cache on and off, prompts longer than a prefill chunk, preemption, and beside generation;
nothing is sampled for them and every KV block comes back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks.tiny_models import load_reference_model, make_tiny_model
from pagedserve.common.invalid_field import InvalidField
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.engine.llm import PROMPT_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return path, load_reference_model(path)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 384) for _ in range(20)]
    return [
        shared + [rng.randrange(3, 384) for _ in range(7)],
        [rng.randrange(3, 384) for _ in range(45)],
        shared,  # whole blocks of the first prompt: a prefix-cache hit where allowed
        [rng.randrange(3, 384)],
    ]


@torch.inference_mode()
def reference(ref_model: Any, prompt: list[int], pooling: PoolingParams) -> torch.Tensor:
    """The pooled final hidden state (after the final norm) of transformers' own forward."""
    out = ref_model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # [P, hidden]: transformers applies the norm to the last
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling.pooling_type]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def assert_close(
    ref_model: Any, items: list[list[int]], got: list[list[float]], pooling: PoolingParams
) -> None:
    assert len(got) == len(items)
    for prompt, vector in zip(items, got, strict=True):
        expected = reference(ref_model, prompt, pooling)
        assert len(vector) == expected.numel()
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5, rtol=0), prompt[:3]
        if pooling.normalize:
            assert abs(float(torch.tensor(vector).norm()) - 1.0) < 1e-5


POOLINGS = [
    PoolingParams(),
    PoolingParams("mean"),
    PoolingParams("cls"),
    PoolingParams("last", normalize=False),
    PoolingParams("mean", normalize=False),
]


@pytest.mark.parametrize(
    "settings",
    [
        {"block_size": 4, "enable_prefix_caching": False},
        {"block_size": 4, "enable_prefix_caching": True},
        # Prompts longer than a prefill chunk, chunked beside one another.
        {"block_size": 4, "enable_prefix_caching": True, "max_num_batched_tokens": 8, "max_num_seqs": 2},
    ],
)
def test_pooling_matches_transformers(model: tuple[Path, Any], settings: dict[str, Any]) -> None:
    path, ref_model = model
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=256, **settings)
    items = prompts()
    engine = llm.engine
    for pooling in POOLINGS:
        first = llm.embed(items, pooling)
        # Again, once the first pass cached these prompts' blocks (a last-token request may
        # take them): the same vectors.
        second = llm.embed(items, pooling)
        assert_close(ref_model, items, first, pooling)
        assert_close(ref_model, items, second, pooling)
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        assert not engine.has_unfinished_requests()
    if settings["enable_prefix_caching"]:
        assert engine.pool.num_cached_blocks > 0  # pooling requests fill the cache for others


def test_pooling_requests_sample_nothing_and_free_their_blocks(model: tuple[Path, Any]) -> None:
    path, _ = model
    llm = LLM(
        str(path), max_model_len=64, block_size=4, enable_prefix_caching=False, num_gpu_blocks_override=64
    )
    engine = llm.engine
    request = engine.add_request(prompts()[1], PROMPT_ONLY, pooling=PoolingParams("mean"))
    steps = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        assert request.request_id not in result.new_tokens
    assert steps == 1  # the whole prompt in one prefill step, then it ends
    assert request.status.value == "stop" and request.num_output_tokens == 0
    assert request.embedding is not None and request.block_table == []
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.release(request.request_id)


def test_pooling_fills_the_context_and_no_more(model: tuple[Path, Any]) -> None:
    """A pooling request generates nothing, so its prompt may be max_model_len tokens long."""
    path, ref_model = model
    llm = LLM(str(path), max_model_len=32, block_size=4, num_gpu_blocks_override=64)
    prompt = [random.Random(1).randrange(3, 384) for _ in range(32)]
    assert_close(ref_model, [prompt], llm.embed([prompt]), PoolingParams())
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.embed([[*prompt, 5]])
    with pytest.raises(ValueError, match="max_model_len is 32"):  # a generation still needs room
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)


def test_pooling_across_preemption_beside_generation(model: tuple[Path, Any]) -> None:
    """A pool too small for everything at once: generations and pooling requests are preempted
    (recomputed) and resumed; every vector still matches, every greedy stream is unchanged."""
    path, ref_model = model
    settings = {"block_size": 4, "max_num_batched_tokens": 9, "watermark": 0.0}
    items = prompts()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = LLM(str(path), max_model_len=128, num_gpu_blocks_override=256, **settings).generate(
        items, greedy, use_tqdm=False
    )
    llm = LLM(
        str(path), max_model_len=128, num_gpu_blocks_override=16, preemption_mode="recompute", **settings
    )
    engine = llm.engine
    gens = [engine.add_request(p, greedy) for p in items]
    pooled = [engine.add_request(p, PROMPT_ONLY, pooling=PoolingParams("mean")) for p in items]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert [g.output_token_ids for g in gens] == [a.token_ids for a in alone]
    assert_close(ref_model, items, [r.embedding or [] for r in pooled], PoolingParams("mean"))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_pooling_params_are_validated(model: tuple[Path, Any]) -> None:
    with pytest.raises(InvalidField, match="pooling_type must be one of last, mean, cls"):
        PoolingParams("max")
    with pytest.raises(InvalidField, match="normalize must be a boolean"):
        PoolingParams("last", normalize=1)  # type: ignore[arg-type]
    path, _ = model
    llm = LLM(str(path), max_model_len=64, block_size=4, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="one sample"):
        llm.engine.add_request([1, 2], SamplingParams(n=2), pooling=PoolingParams())
    assert not llm.engine.has_unfinished_requests()
