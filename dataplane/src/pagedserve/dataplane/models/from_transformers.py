"""Which model implementation runs a loaded checkpoint, and the owned model built from its weights.

The loaders (dataplane/src/pagedserve/dataplane/runner/model_loader.py, gguf_loader.py) read a checkpoint into
transformers' module tree, which names and shapes every tensor; `build_causal_lm` then moves
those tensors into the owned model of its architecture (q/k/v and gate/up concatenated into
one linear each) and drops transformers' modules, or, for an architecture without a model file
here, wraps transformers' model (`TransformersCausalLM`). The choice is logged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.common.log import get_logger
from pagedserve.dataplane.config import MODEL_IMPLS
from pagedserve.dataplane.models.base import CausalLM
from pagedserve.dataplane.models.layers import STATIC_ROPE_TYPES, RMSNorm
from pagedserve.dataplane.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.dataplane.models.transformers_backend import TransformersCausalLM

log = get_logger(__name__)

# Decoder layer classes whose forward is exactly the owned Llama layer's: pre-norm attention
# (q/k/v/o, optional q_norm/k_norm over head_dim before rotary), residual, pre-norm gated MLP
# (silu(gate) * up -> down), residual. Sliding-window configs attend over the whole context
# in our paged kernels either way (the engine caps the context at the window).
LLAMA_FAMILY_LAYERS = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)


def unowned_reason(hf_model: Any) -> str | None:
    """Why the owned models cannot run this transformers model; None when one can."""
    decoder = hf_model.get_decoder() if callable(getattr(hf_model, "get_decoder", None)) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return f"{type(hf_model).__name__} has no decoder layer list"
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= LLAMA_FAMILY_LAYERS:
        return f"no model file for {', '.join(sorted(kinds))}"
    config = hf_model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the owned layers compute silu)"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r}"
    return None


def build_causal_lm(hf_model: Any, model_impl: str = "auto") -> CausalLM:
    """The model the engine runs for a loaded transformers model: the owned one where its
    architecture has a model file (`model_impl` "auto" or "pagedserve"; the latter refuses an
    architecture without one), else transformers' own (`model_impl` "transformers" forces it)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    reason = None if model_impl == "transformers" else unowned_reason(hf_model)
    architecture = type(hf_model).__name__
    if model_impl == "pagedserve" and reason is not None:
        raise ValueError(f"model_impl pagedserve: {architecture} cannot run on the owned models ({reason})")
    if model_impl == "transformers" or reason is not None:
        log.info(
            "model_implementation", implementation="transformers", architecture=architecture,
            reason=reason or "--model-impl transformers",
        )  # fmt: skip
        return TransformersCausalLM(hf_model)
    model = llama_from_transformers(hf_model)
    log.info("model_implementation", implementation="pagedserve", architecture=architecture)
    return model


def llama_from_transformers(hf_model: Any) -> LlamaForCausalLM:
    """The owned Llama-family model holding `hf_model`'s tensors; `hf_model`'s decoder layers
    are emptied as they are taken, so the concatenated projections never coexist with more
    than one layer's originals."""
    config = hf_model.config
    decoder = hf_model.get_decoder()
    layers = []
    for i in range(len(decoder.layers)):
        layers.append(_layer(decoder.layers[i], i))
        decoder.layers[i] = nn.Identity()
    model = LlamaForCausalLM(
        config,
        embed_tokens=decoder.embed_tokens,
        layers=layers,
        norm=_norm(decoder.norm),
        lm_head=hf_model.get_output_embeddings(),
        dtype=hf_model.dtype,
        generation_config=getattr(hf_model, "generation_config", None),
    )
    device = _device(model)
    model.rotary.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _layer(layer: Any, layer_idx: int) -> LlamaDecoderLayer:
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(attn.head_dim)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LlamaDecoderLayer(
        layer_idx,
        qkv_proj=concat_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
        o_proj=attn.o_proj,
        gate_up_proj=concat_linears([mlp.gate_proj, mlp.up_proj]),
        down_proj=mlp.down_proj,
        input_layernorm=_norm(layer.input_layernorm),
        post_attention_layernorm=_norm(layer.post_attention_layernorm),
        head_dim=head_dim,
        num_heads=attn.q_proj.out_features // head_dim,
        num_kv_heads=attn.k_proj.out_features // head_dim,
        scaling=float(attn.scaling),
        qk_norm=None if q_norm is None or k_norm is None else (_norm(q_norm), _norm(k_norm)),
    )


def _norm(module: Any) -> RMSNorm:
    return RMSNorm(module.weight, float(module.variance_epsilon))


def _device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def concat_linears(linears: list[Any]) -> nn.Module:
    """One linear whose output is the given linears' outputs side by side (rows stacked): an
    nn.Linear, or, for quantized ones (a GGUF model's), their class's own `concat`."""
    first = linears[0]
    if all(type(lin) is type(first) for lin in linears) and callable(getattr(type(first), "concat", None)):
        fused_quant: nn.Module = type(first).concat(linears)
        return fused_quant
    if any(not isinstance(lin, nn.Linear) for lin in linears):
        raise TypeError(f"expected nn.Linear projections, got {[type(lin).__name__ for lin in linears]}")
    if any(lin.in_features != first.in_features for lin in linears):
        raise ValueError(f"projections differ in in_features: {[lin.in_features for lin in linears]}")
    fused = nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=any(lin.bias is not None for lin in linears),
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears], dim=0))
        if fused.bias is not None:
            # A projection without bias contributes zeros: adding 0.0 changes no value.
            fused.bias.copy_(
                torch.cat(
                    [
                        lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                        for lin in linears
                    ]
                )
            )
    fused.requires_grad_(False)
    return fused
