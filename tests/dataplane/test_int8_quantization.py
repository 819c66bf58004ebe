"""`quantization="int8"` (`--quantization int8`): a float checkpoint's linear weights quantized at
load, per output channel, symmetric, and served on the C++ quantized kernel. Its greedy
tokens equal an fp32 engine's on the de-quantized int8 weights (the kernel equals the fp32
panels on them bit for bit), on tiny Llama and Qwen2 models; bad combinations are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pagedserve.benchmarks.tiny_models import exactness_workload, make_tiny_model
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.config import ModelConfig
from pagedserve.kernels.quant import quantize_int8


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_greedy_tokens_equal_fp32_on_the_dequantized_weights(arch: str, tmp_path: Path) -> None:
    folder = make_tiny_model(arch, tmp_path / "model", seed=4)
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    dequantized = {
        name: quantize_int8(t).dequantize() if t.dim() == 2 and "embed_tokens" not in name else t
        for name, t in state.items()
    }
    save_file(dequantized, twin / "model.safetensors")

    prompts = [p for p, _ in exactness_workload(seed=9)[:8]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), quantization="int8", quantized_matmul="float32", kv_cache_memory=8 << 20)
    linears = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "QuantPanelLinear"]
    assert len(linears) == 2 * 4 + 1  # per layer fused qkv, o, gate_up, down; and the LM head
    assert all(m.kind == "int8" for m in linears)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = LLM(str(twin), kv_cache_memory=8 << 20).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_int8_needs_float32_on_the_cpu(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "model", seed=4)
    with pytest.raises(ValueError, match="quantization int8 runs on the CPU with float32 activations"):
        LLM(str(folder), quantization="int8", dtype="bfloat16", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int4")


def test_int8_refuses_tensor_parallelism_by_name(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "model", seed=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: quantization int8 runs on one rank"):
        LLM(str(folder), quantization="int8", tensor_parallel_size=2, kv_cache_memory=8 << 20)
