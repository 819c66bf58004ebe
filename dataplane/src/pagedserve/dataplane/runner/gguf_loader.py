"""Builds a model from a GGUF folder (pagedserve.common.models.gguf_folder): quantized tensors
stay quantized (QuantLinear / QuantEmbedding, quant_linear.py), float tensors load as they are.

The model is the transformers class that the folder's config.json names, built with its
parameters on the meta device (no float32 copy of the weights is ever made), then every
parameter is taken from the file: norms and any float weights as tensors, quantized linear
and embedding weights as modules holding the quantized values. A tensor the model needs
that the file lacks, or one the file has that the model does not, is an error naming it.

llama.cpp's converter reorders the rows of a llama-architecture model's q and k projections
(its rotary pairs adjacent dimensions; transformers' pairs the two halves): the loader
restores transformers' order, as transformers' own GGUF loader does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.dataplane.runner.cpu_linear import replace_module
from pagedserve.dataplane.runner.quant_linear import QuantEmbedding, QuantLinear
from pagedserve.kernels.gguf_blocks import decode_blocks
from pagedserve.kernels.quant import QuantizedWeight

# GGUF tensor name -> the transformers module path (Llama, Qwen2, Qwen3 layouts); {i} is the layer.
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
_PATTERNS = [
    (re.compile("^" + re.escape(gguf).replace(r"\{i\}", r"(\d+)") + r"\.(weight|bias)$"), module)
    for gguf, module in TENSOR_NAMES.items()
]


def module_path(gguf_name: str) -> tuple[str, str] | None:
    """(transformers module path, "weight" or "bias") of a GGUF tensor name; None if unknown."""
    for pattern, module in _PATTERNS:
        match = pattern.match(gguf_name)
        if match:
            groups = match.groups()
            return (module.replace("{i}", groups[0]) if len(groups) == 2 else module), groups[-1]
    return None


def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row index restoring transformers' order of a q or k projection that llama.cpp's
    converter permuted (per head: [h, 2, d/2] -> [h, d/2, 2])."""
    half = rows // heads // 2
    permuted = torch.arange(rows).view(heads, 2, half).transpose(1, 2).reshape(-1)
    return torch.argsort(permuted)


def _float_tensor(tensor: Any) -> torch.Tensor:
    data = np.array(tensor.data)  # a copy: the reader's arrays map the file read-only
    if tensor.tensor_type.name == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).to(torch.float32)
    return torch.from_numpy(data.astype(np.float32, copy=False))


def load_gguf_model(folder: Path, gguf_path: Path, attn_implementation: str) -> Any:
    """The causal LM of `folder` (config.json) with its weights from `gguf_path`."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    reader = GGUFReader(str(gguf_path))
    arch_field = reader.fields["general.architecture"]
    permute_qk = bytes(arch_field.parts[arch_field.data[0]]).decode() == "llama"
    loaded: set[str] = set()
    for tensor in reader.tensors:
        target = module_path(tensor.name)
        if target is None:
            if tensor.name.startswith("rope_freqs"):  # llama.cpp's own rotary table: ours comes from config
                continue
            raise ValueError(f"{gguf_path}: tensor {tensor.name!r} has no place in {type(model).__name__}")
        path, kind = target
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        heads = _qk_heads(path, config) if permute_qk else None
        if tensor.tensor_type.name in ("F32", "F16", "BF16"):
            value = _float_tensor(tensor).reshape(shape)
            if heads is not None:
                value = value[rotary_row_order(shape[0], heads)]
            _set_tensor(model, path, kind, value)
        else:
            if kind != "weight" or len(shape) != 2:
                raise ValueError(f"{gguf_path}: quantized tensor {tensor.name!r} must be a 2-D weight")
            weight = decode_blocks(tensor.name, tensor.tensor_type.name, tensor.data, shape[0], shape[1])
            if heads is not None:
                weight = weight.rows(rotary_row_order(shape[0], heads))
            _set_quantized(model, path, weight)
        loaded.add(f"{path}.{kind}")
    if "lm_head.weight" not in loaded and getattr(config, "tie_word_embeddings", False):
        embed = model.get_input_embeddings()
        model.lm_head = QuantLinear(embed.weight_q) if isinstance(embed, QuantEmbedding) else _tied(embed)
        loaded.add("lm_head.weight")
    _materialize_buffers(model, config)
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(
            f"{gguf_path}: no tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    model.eval()
    model.requires_grad_(False)
    return model


def _qk_heads(path: str, config: Any) -> int | None:
    if path.endswith("self_attn.q_proj"):
        return int(config.num_attention_heads)
    if path.endswith("self_attn.k_proj"):
        return int(config.num_key_value_heads)
    return None


def _set_tensor(model: nn.Module, path: str, kind: str, value: torch.Tensor) -> None:
    module = model.get_submodule(path)
    current = getattr(module, kind, None)
    if isinstance(module, QuantLinear) and kind == "bias":
        module.bias = nn.Parameter(value.reshape(module.out_features), requires_grad=False)
        return
    if current is None or tuple(current.shape) != tuple(value.shape):
        expected = None if current is None else tuple(current.shape)
        raise ValueError(
            f"tensor for {path}.{kind} has shape {tuple(value.shape)}, the model expects {expected}"
        )
    setattr(module, kind, nn.Parameter(value, requires_grad=False))


def _set_quantized(model: nn.Module, path: str, weight: QuantizedWeight) -> None:
    module = model.get_submodule(path)
    if isinstance(module, nn.Embedding):
        if (module.num_embeddings, module.embedding_dim) != (weight.out_features, weight.in_features):
            raise ValueError(
                f"{path}: {weight.kind} weight {weight.out_features}x{weight.in_features} does not fit {module}"
            )
        replace_module(model, path, QuantEmbedding(weight, module.padding_idx))
        return
    if not isinstance(module, nn.Linear) or (module.out_features, module.in_features) != (
        weight.out_features,
        weight.in_features,
    ):
        raise ValueError(
            f"{path}: {weight.kind} weight {weight.out_features}x{weight.in_features} does not fit {module}"
        )
    bias = module.bias if module.bias is not None and module.bias.device.type != "meta" else None
    replace_module(model, path, QuantLinear(weight, bias))


def _tied(embed: nn.Module) -> nn.Linear:
    """An LM head sharing a float embedding's weight."""
    weight = embed.weight
    if not isinstance(weight, nn.Parameter):
        raise ValueError(f"cannot tie the LM head to {type(embed).__name__}")
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight
    return head


def _materialize_buffers(model: nn.Module, config: Any) -> None:
    """Buffers built on the meta device (the rotary tables) rebuilt on the CPU from config."""
    for name, module in model.named_modules():
        if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            if not name.endswith("rotary_emb"):
                raise ValueError(f"cannot build {name} ({type(module).__name__}) outside the meta device")
            with torch.device("cpu"):
                replace_module(model, name, type(module)(config=config))
