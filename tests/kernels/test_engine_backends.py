"""The engine with each attention backend and KV cache dtype, on tiny random models.

The Triton backend runs in Triton's interpreter here (tests/kernels/conftest.py), so its
greedy tokens are checked against transformers exactly like tests/test_engine_exactness.py
checks the default backend, on a smaller workload (the interpreter is slow).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks.tiny_models import (
    Reference,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
)
from pagedserve.benchmarks.tiny_models import exactness_workload as workload
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.kernels.backend import ResolvedBackends, resolve_backend
from tests.dataplane.test_engine_exactness import assert_no_leaks, check_all

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Reference]]]:
    out = {}
    for arch in ("llama", "qwen3", "mistral"):
        path = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        ref_model = load_reference_model(path)
        refs = [reference_greedy(ref_model, prompt, n) for prompt, n in workload()[:NUM_PROMPTS]]
        out[arch] = (path, refs)
    return out


def generate(path: Path, n: int = NUM_PROMPTS, **kwargs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), max_model_len=256, **kwargs)
    items = workload()[:n]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in items]
    return llm, [o.token_ids for o in llm.generate([p for p, _ in items], params, use_tqdm=False)]


# qwen3: 2 kv heads x 3 (head_dim 16, q/k norms); mistral: 1 x 8 (head_dim 8); llama (2 x 2) below.
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_triton_backend_greedy_matches_transformers(tiny_models: dict[str, Any], arch: str) -> None:
    path, refs = tiny_models[arch]
    llm, tokens = generate(
        path, block_size=16, max_num_seqs=NUM_PROMPTS, kv_cache_memory=2**20, attention_backend="triton"
    )
    assert llm.engine.runner.backends.attention == "triton"
    check_all(tokens, refs, f"{arch} triton")
    assert_no_leaks(llm)


def test_triton_backend_chunked_prefill_and_preemption(tiny_models: dict[str, Any]) -> None:
    path, refs = tiny_models["llama"]
    # 4-token blocks, 7-token steps (chunks with cached prefixes), a pool too small for all.
    llm, tokens = generate(
        path,
        n=4,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=7,
        num_gpu_blocks_override=24,
        attention_backend="triton",
    )
    assert llm.engine.scheduler.num_preemptions > 0
    check_all(tokens, refs[:4], "llama triton chunked")
    assert_no_leaks(llm)


def test_fp8_backends_agree(tiny_models: dict[str, Any]) -> None:
    # Both backends quantize to the same bits and attend within fp32 rounding of each other
    # (e5m2 differs only in the quantizer's constants, tested bit-exact in test_triton_kernels).
    kv_cache_dtype = "fp8_e4m3"
    path, _ = tiny_models["qwen3"]
    outs = []
    for backend in ("torch", "triton"):
        llm, tokens = generate(
            path, n=4, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=2**20, attention_backend=backend
        )
        assert_no_leaks(llm)
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_fp8_pool_holds_2x_the_blocks_of_16_bit_and_4x_of_fp32(tiny_models: dict[str, Any]) -> None:
    path, _ = tiny_models["llama"]
    memory = 3 * 2**20  # a multiple of every block size below, so the ratios are exact
    blocks = {}
    for dtype, kv in [
        ("float32", "auto"),
        ("bfloat16", "auto"),
        ("float32", "fp8_e4m3"),
        ("bfloat16", "fp8_e5m2"),
    ]:
        engine = LLM(
            str(path), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory, max_model_len=256
        ).engine
        key_cache = engine.runner.kv_caches[0][0]
        assert key_cache.element_size() == (1 if kv != "auto" else 4 if dtype == "float32" else 2)
        assert key_cache.shape[0] == engine.budget.num_blocks
        blocks[(dtype, kv)] = engine.budget.num_blocks
        if kv != "auto":
            assert key_cache.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
            assert (
                engine.budget.num_blocks == 2 * engine.budget.blocks_at(2) == 4 * engine.budget.blocks_at(4)
            )
    fp32, bf16 = blocks[("float32", "auto")], blocks[("bfloat16", "auto")]
    assert blocks[("float32", "fp8_e4m3")] == blocks[("bfloat16", "fp8_e5m2")] == 2 * bf16 == 4 * fp32


def test_fp8_scales_file_round_trip(tiny_models: dict[str, Any], tmp_path: Path) -> None:
    path, _ = tiny_models["llama"]
    llm, tokens = generate(path, n=4, kv_cache_dtype="fp8_e4m3", kv_cache_memory=2**20)
    scales = llm.engine.kv_scales
    assert scales is not None and scales.source.startswith("calibrated")
    assert len(scales.k_scale) == 2 and all(s != 1.0 for s in scales.k_scale + scales.v_scale)
    file = tmp_path / "scales.json"
    scales.save(file, "fp8_e4m3")
    assert json.loads(file.read_text())["k_scale"] == list(scales.k_scale)
    llm2, tokens2 = generate(
        path, n=4, kv_cache_dtype="fp8_e4m3", kv_cache_memory=2**20, kv_scales_path=str(file)
    )
    assert llm2.engine.kv_scales is not None and llm2.engine.kv_scales.k_scale == scales.k_scale
    assert tokens2 == tokens
    with pytest.raises(ValueError, match="not fp8_e5m2"):
        LLM(str(path), kv_cache_dtype="fp8_e5m2", kv_scales_path=str(file), max_model_len=256)
    file.write_text(json.dumps({"k_scale": [0.1], "v_scale": [0.1, 0.2]}))
    with pytest.raises(ValueError, match="2 layers"):
        LLM(str(path), kv_cache_dtype="fp8_e4m3", kv_scales_path=str(file), max_model_len=256)


def test_fp8_scale_1_fallback_warns_loudly(
    tiny_models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagedserve.dataplane.engine.startup as startup

    warnings: list[tuple[str, dict[str, Any]]] = []
    real = startup.log

    class Recorder:
        def warning(self, event: str, **kw: Any) -> None:
            warnings.append((event, kw))

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(startup, "log", Recorder())
    path, _ = tiny_models["llama"]
    engine = LLM(str(path), kv_cache_dtype="fp8_e4m3", calculate_kv_scales=False, max_model_len=256).engine
    assert engine.kv_scales is not None and set(engine.kv_scales.k_scale) == {1.0}
    assert [event for event, _ in warnings] == ["kv_scales_default_1_0"]
    assert "1.0" in warnings[0][1]["message"]


def test_backend_and_dtype_validation(tiny_models: dict[str, Any]) -> None:
    from pagedserve.dataplane.config import CacheConfig, ModelConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs an FP8"):
        CacheConfig(kv_scales_path="x.json")
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flash")


def test_cpu_engine_resolves_the_cpp_paths() -> None:
    cpu = torch.device("cpu")
    fp32 = resolve_backend(None, cpu, torch.float32, torch.float32)
    assert fp32 == ResolvedBackends(attention="cpp", cache="torch", cache_write="cpp")
    # FP8 caches quantize on write: the torch write, with the C++ attention
    fp8 = resolve_backend(None, cpu, torch.float32, torch.float8_e4m3fn)
    assert (fp8.attention, fp8.cache_write) == ("cpp", "torch")
    bf16 = resolve_backend(None, cpu, torch.bfloat16, torch.bfloat16)
    assert (bf16.attention, bf16.cache_write) == ("torch", "torch")
