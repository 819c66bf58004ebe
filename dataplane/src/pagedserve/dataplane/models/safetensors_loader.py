"""A safetensors checkpoint of the Llama family read straight into the owned model.

transformers' module tree is built on the meta device only, as the schema of the checkpoint
(which tensors exist, their shapes, which projections have biases); the owned model is built
from it with every parameter still on the meta device, then each checkpoint tensor is read
once, cast to the model's dtype and copied into its place: q/k/v into their rows of the fused
q/k/v projection, gate/up into theirs. No full-precision copy of transformers' model is ever
made. A tensor the model needs that the checkpoint lacks, or one it has that the model does
not, is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.models.from_transformers import llama_from_transformers, unowned_reason
from pagedserve.dataplane.models.llama import LlamaForCausalLM

# checkpoint tensor (under model.layers.{i}.) -> (owned module, part index among the fused parts)
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {
    "self_attn.o_proj": "o_proj",
    "mlp.down_proj": "down_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
_TOP = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: those its index names, else the one model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    single = path / "model.safetensors"
    return [single] if single.exists() else []


def load_owned_safetensors(
    path: Path, config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str
) -> LlamaForCausalLM | None:
    """The owned model of `path`'s checkpoint, or None when its architecture has no model
    file here (the caller then loads transformers' model)."""
    from transformers import AutoModelForCausalLM

    files = safetensors_files(path)
    if not files:
        return None
    with torch.device("meta"):
        schema = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    if unowned_reason(schema) is not None:
        return None
    model = llama_from_transformers(schema)
    targets = _fused_offsets(model)
    rows: dict[str, int] = {}  # parameter -> rows filled (a fused one is filled part by part)
    for file in files:
        _read_file(model, file, targets, dtype, device, rows)
    if "lm_head.weight" not in rows and getattr(config, "tie_word_embeddings", False):
        embedding: torch.Tensor = model.embed_tokens.weight  # type: ignore[assignment]
        model.lm_head.weight = embedding
        rows["lm_head.weight"] = int(embedding.shape[0])
    missing = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.device.type == "meta" or rows.get(name) != p.shape[0]
    ]
    if missing:
        raise ValueError(
            f"{path}: no tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    for layer in model.decoder_layers():
        layer.set_local_heads(layer.num_heads, layer.num_kv_heads)  # the stacked q/k norm, now loaded
    model.rotary.to(device)
    model.generation_config = _generation_config(path)
    return model


def _fused_offsets(model: LlamaForCausalLM) -> dict[int, tuple[list[int], list[int]]]:
    """Per layer, the row offsets of q/k/v in qkv_proj and of gate/up in gate_up_proj."""
    out = {}
    for i, layer in enumerate(model.decoder_layers()):
        d = layer.head_dim
        q, kv = layer.num_heads * d, layer.num_kv_heads * d
        inter = _out_features(layer.gate_up_proj) // 2
        out[i] = ([0, q, q + kv, q + 2 * kv], [0, inter, 2 * inter])
    return out


def _out_features(module: nn.Module) -> int:
    return int(getattr(module, "out_features"))  # noqa: B009  (nn.Module's attributes are dynamic)


def _read_file(
    model: LlamaForCausalLM,
    file: Path,
    offsets: dict[int, tuple[list[int], list[int]]],
    dtype: torch.dtype,
    device: torch.device,
    rows: dict[str, int],
) -> None:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
            target, part = _place(name, offsets)
            if target is None:
                raise ValueError(f"{file}: tensor {name!r} has no place in {type(model).__name__}")
            tensor = f.get_tensor(name).to(dtype)
            _copy(model, target, part, tensor, device)
            rows[target] = rows.get(target, 0) + tensor.shape[0]


def _place(name: str, offsets: dict[int, tuple[list[int], list[int]]]) -> tuple[str | None, slice | None]:
    """The owned parameter a checkpoint tensor goes to, and its rows there (None: all)."""
    module, _, kind = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{kind}", None
    parts = module.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None, None
    layer, inner = int(parts[2]), ".".join(parts[3:])
    prefix = f"layers.{layer}"
    if inner in _RENAMED:
        return f"{prefix}.{_RENAMED[inner]}.{kind}", None
    if inner in _FUSED and layer in offsets:
        fused, part = _FUSED[inner]
        bounds = offsets[layer][0 if fused == "qkv_proj" else 1]
        return f"{prefix}.{fused}.{kind}", slice(bounds[part], bounds[part + 1])
    return None, None


def _copy(
    model: nn.Module, target: str, rows: slice | None, tensor: torch.Tensor, device: torch.device
) -> None:
    module_name, _, kind = target.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, kind, None)
    if not isinstance(current, torch.Tensor):
        raise ValueError(f"{target}: the model has no such tensor")
    if current.device.type == "meta":
        current = nn.Parameter(
            torch.empty(current.shape, dtype=current.dtype, device=device), requires_grad=False
        )
        setattr(module, kind, current)
    part = current.data if rows is None else current.data[rows]
    if tuple(part.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor for {target} has shape {tuple(tensor.shape)}, the model expects {tuple(part.shape)}"
        )
    part.copy_(tensor)


def _generation_config(path: Path) -> Any:
    from transformers import GenerationConfig

    if not (path / "generation_config.json").exists():
        return None
    return GenerationConfig.from_pretrained(str(path), local_files_only=True)
