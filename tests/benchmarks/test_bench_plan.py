"""`bench plan`: the budget formula for real model configs, and figures often quoted about
PagedAttention checked (docs/capacity-planning.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.benchmarks.plan import BUILTIN_MODELS, ModelShape, parse_gpu, plan, resolve_model

GiB = 2**30


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("LLaMA-7B", 6_738_415_616),
        ("LLaMA-13B", 13_015_864_320),
        ("LLaMA-70B", 68_976_648_192),
        ("Llama-3-8B", 8_030_261_248),
        ("Llama-3-70B", 70_553_706_496),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Qwen2.5-72B", 72_706_203_648),
    ],
)
def test_parameter_counts_match_the_published_ones(name: str, parameters: int) -> None:
    assert BUILTIN_MODELS[name].num_parameters == parameters


def test_kv_bytes_per_token_by_dtype_and_tensor_parallelism() -> None:
    llama7b = BUILTIN_MODELS["LLaMA-7B"]
    assert llama7b.kv_shape("float16").bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert llama7b.kv_shape("fp8_e4m3").bytes_per_token == 262_144
    assert llama7b.kv_shape("float32").bytes_per_token == 1_048_576
    llama3_70b = BUILTIN_MODELS["Llama-3-70B"]  # 8 KV heads: 2 per GPU at tp 4, replicated at tp 16
    assert llama3_70b.kv_shape("float16", 4).num_kv_heads == 2
    assert llama3_70b.kv_shape("float16", 16).num_kv_heads == 1


def test_llama_7b_batch_32_of_2048_needs_32_gib_not_14_gb() -> None:
    per_token = BUILTIN_MODELS["LLaMA-7B"].kv_shape("float16").bytes_per_token
    assert per_token * 32 * 2048 == 32 * GiB


def test_llama_13b_on_an_80_gb_a100_admits_30_not_8() -> None:
    m = BUILTIN_MODELS["LLaMA-13B"]
    at_2048 = plan(m, parse_gpu("A100-80GB"), "float16", max_model_len=2048, avg_tokens=512)
    assert at_2048.weight_bytes == 26_031_728_640
    assert at_2048.kv_memory_bytes == int(80 * GiB * 0.9) - 26_031_728_640 - at_2048.activation_bytes
    assert at_2048.kv_memory_bytes // (2048 * 819_200) == at_2048.contiguous_concurrency == 30
    assert at_2048.num_blocks == at_2048.kv_memory_bytes // (16 * 819_200) == 3890
    assert at_2048.max_concurrency == 3890 // 32 == 121
    assert plan(m, 80, "float16", max_model_len=4096).contiguous_concurrency == 15
    assert plan(m, parse_gpu("A100-40GB"), "float16", max_model_len=2048).contiguous_concurrency == 7


def test_a_70b_model_needs_more_than_one_80_gb_gpu() -> None:
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        plan(BUILTIN_MODELS["Llama-3-70B"], 80, "float16")
    two = plan(BUILTIN_MODELS["Llama-3-70B"], 80, "float16", tensor_parallel_size=2)
    assert two.kv_bytes_per_token == 2 * 80 * 4 * 128 * 2


def test_local_hf_config_folder(tmp_path: Path) -> None:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = resolve_model(str(tmp_path))
    assert m == ModelShape(tmp_path.name, 30, 576, 9, 3, 64, 1536, 49152, 8192, tie_word_embeddings=True)
    assert m.num_parameters == BUILTIN_MODELS["SmolLM2-135M"].num_parameters == 134_515_008
    with pytest.raises(FileNotFoundError, match="built-in model"):
        resolve_model(str(tmp_path / "missing"))


def test_quantized_weights_count_their_packed_bytes_and_free_kv_memory() -> None:
    m = BUILTIN_MODELS["LLaMA-13B"]
    fp16 = plan(m, 80, "float16", weight_dtype="float16", max_model_len=2048)
    q4 = plan(m, 80, "float16", weight_dtype="q4_1", max_model_len=2048)
    # 0.5 byte per value + an fp16 scale and min per 32 weights: 0.625 bytes per weight
    assert q4.weight_bytes == -(-m.num_parameters * 5 // 8)
    assert q4.weight_bytes * 16 == fp16.weight_bytes * 5
    # activations in fp32 (twice fp16's), the rest of the freed weight memory goes to the KV pool
    assert q4.activation_bytes > fp16.activation_bytes
    assert q4.kv_memory_bytes - fp16.kv_memory_bytes == (fp16.weight_bytes - q4.weight_bytes) - (
        q4.activation_bytes - fp16.activation_bytes
    )
    assert plan(m, 80, "float16", weight_dtype="q8_0").weight_bytes == -(-m.num_parameters * 17 // 16)
    assert plan(m, 80, "float16", weight_dtype="q4_k").weight_bytes == -(-m.num_parameters * 3 // 4)
