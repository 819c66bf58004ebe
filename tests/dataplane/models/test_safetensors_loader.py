"""A safetensors checkpoint read straight into the owned model holds exactly the tensors that
transformers' loader gives, for every owned architecture; a checkpoint that lacks a tensor or
has one the model does not is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.benchmarks.tiny_models import make_tiny_model, tiny_config
from pagedserve.dataplane.models import LlamaForCausalLM, TransformersCausalLM, build_causal_lm
from pagedserve.dataplane.models.safetensors_loader import load_owned_safetensors, safetensors_files
from pagedserve.dataplane.models.transformers_backend import register_paged_attention

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def via_transformers(path: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=register_paged_attention()
    )
    model = build_causal_lm(hf.eval())
    assert isinstance(model, LlamaForCausalLM)
    return model


def direct(path: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    return load_owned_safetensors(path, config, dtype, torch.device("cpu"), register_paged_attention())


def assert_same_tensors(got: LlamaForCausalLM, want: LlamaForCausalLM) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name], tensor), name
    for a, b in zip(got.decoder_layers(), want.decoder_layers(), strict=True):
        assert (a.num_heads, a.num_kv_heads, a.head_dim, a.scaling) == (
            b.num_heads,
            b.num_kv_heads,
            b.head_dim,
            b.scaling,
        )
        if b.qk_norm_weight is not None:
            assert a.qk_norm_weight is not None and torch.equal(a.qk_norm_weight, b.qk_norm_weight)
    assert torch.equal(got.rotary.inv_freq, want.rotary.inv_freq)


@pytest.mark.parametrize("arch", ARCHS)
def test_direct_load_equals_transformers_load(arch: str, tmp_path: Path) -> None:
    path = make_tiny_model(arch, tmp_path / arch)
    got = direct(path)
    assert isinstance(got, LlamaForCausalLM)
    assert_same_tensors(got, via_transformers(path))
    assert not any(p.device.type == "meta" for p in got.parameters())


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path = make_tiny_model("qwen2", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    got = direct(path)
    assert got is not None and got.lm_head.weight is got.embed_tokens.weight


def test_a_sharded_checkpoint_and_a_cast_to_bfloat16(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    path = tmp_path / "sharded"
    hf.save_pretrained(path, max_shard_size="40KB")
    files = safetensors_files(path)
    assert len(files) > 1 and all(f.exists() for f in files)
    for dtype in (torch.float32, torch.bfloat16):
        got = direct(path, dtype)
        assert got is not None
        assert_same_tensors(got, via_transformers(path, dtype))


def test_missing_and_unknown_tensors_are_refused_by_name(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path / "llama")
    tensors = load_file(path / "model.safetensors")
    v_proj = tensors.pop("model.layers.1.self_attn.v_proj.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor for layers\.1\.qkv_proj\.weight"):
        direct(path)
    tensors["model.layers.1.self_attn.v_proj.weight"] = v_proj
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.extra\.weight' has no place"):
        direct(path)


def test_an_unowned_architecture_is_left_to_transformers(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path / "gelu", hidden_act="gelu")
    assert direct(path) is None
    from pagedserve.dataplane.runner.model_loader import load_model

    assert isinstance(load_model(path, "float32", "cpu"), TransformersCausalLM)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_act"] == "gelu"
