"""Benchmark model shapes: each layout's config field by field, the cache folder keyed by its
content, and the engine on the Qwen2-0.5B layout (its layer count shrunk to keep the test short)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.model_shapes import (
    SHAPES,
    content_key,
    ensure_shape_model,
    shape_config,
)

TOKENIZER = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

# The public checkpoints' config.json fields, with the tokenizer's vocabulary and ids.
EXPECTED: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
}


def test_every_shape_has_its_expected_fields() -> None:
    assert set(SHAPES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_fields(name: str) -> None:
    cfg = shape_config(name, TOKENIZER).to_dict()
    want = {**EXPECTED[name], **TOKENIZER, "initializer_range": 0.02, "dtype": "bfloat16"}
    assert {k: cfg[k] for k in want} == want


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_weights_have_the_layout(name: str) -> None:
    """The drawn tensors of a 1-layer version: the checkpoint's names and shapes, the tied head
    left out, q/k/v biases exactly where the architecture has them, q/k norms for Qwen3."""
    import torch

    from pagedserve.benchmarks.model_shapes import draw_weights

    cfg = shape_config(name, TOKENIZER, num_hidden_layers=1, vocab_size=64)
    weights = draw_weights(cfg)
    e = EXPECTED[name]
    head_dim = e.get("head_dim", e["hidden_size"] // e["num_attention_heads"])
    q_out, kv_out = e["num_attention_heads"] * head_dim, e["num_key_value_heads"] * head_dim
    attn = "model.layers.0.self_attn."
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (64, e["hidden_size"])
    assert weights[attn + "q_proj.weight"].shape == (q_out, e["hidden_size"])
    assert weights[attn + "k_proj.weight"].shape == (kv_out, e["hidden_size"])
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (e["hidden_size"], e["intermediate_size"])
    assert (attn + "q_proj.bias" in weights) == (e["model_type"] == "qwen2")
    assert (attn + "q_norm.weight" in weights) == (e["model_type"] == "qwen3")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(e["hidden_size"], dtype=torch.bfloat16))
    again = draw_weights(cfg)
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_content_key_follows_the_config(tmp_path: Path) -> None:
    a = content_key(shape_config("qwen2-0.5b", TOKENIZER), tmp_path)
    assert a == content_key(shape_config("qwen2-0.5b", TOKENIZER), tmp_path)
    assert a != content_key(shape_config("qwen2-0.5b", TOKENIZER, num_hidden_layers=2), tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert a != content_key(shape_config("qwen2-0.5b", TOKENIZER), tmp_path)


def test_unknown_shape() -> None:
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_config("gpt-5", TOKENIZER)


@pytest.fixture(scope="module")
def qwen2_folder(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_shape_model("qwen2-0.5b", root=tmp_path_factory.mktemp("cache"), num_hidden_layers=2)


def test_engine_generates_on_the_qwen2_shape(default_model_path: Path, qwen2_folder: Path) -> None:
    """Written once into the cache, found there the second time; the engine loads it, and
    greedy decoding gives the same tokens from a fresh engine."""
    from pagedserve.dataplane import LLM, SamplingParams

    folder, root = qwen2_folder, qwen2_folder.parent.parent
    assert folder.parent.name == "model-shapes"
    assert folder.name.startswith("qwen2-0.5b-")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_shape_model("qwen2-0.5b", root=root, num_hidden_layers=2) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 896, 49152)
    assert (folder / "tokenizer.json").read_bytes() == (default_model_path / "tokenizer.json").read_bytes()

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert runs[0] == runs[1]
    assert [len(t) for t in runs[0]] == [8, 8]


def test_fp32_greedy_matches_transformers(qwen2_folder: Path) -> None:
    """The engine's fp32 greedy tokens on the shape equal transformers' own generate, up to
    the numerical ties tiny_models.assert_same_greedy accepts."""
    from pagedserve.benchmarks.tiny_models import assert_same_greedy, load_reference_model, reference_greedy
    from pagedserve.dataplane import LLM, SamplingParams

    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 33, 28, 216, 34, 28, 216, 35, 28], [9520]]
    ref_model = load_reference_model(qwen2_folder)
    refs = [reference_greedy(ref_model, p, 12) for p in prompts]
    llm = LLM(str(qwen2_folder), dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_same_greedy(list(out.token_ids), ref, f"prompt {i}")
