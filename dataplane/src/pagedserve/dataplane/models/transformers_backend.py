"""Any causal LM transformers can build, run through our paged attention: the fallback for
architectures the engine has no model file of (`--model-impl transformers` forces it).

transformers' decoder layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with the projected, rotary-embedded q/k/v and pass through any extra keyword arguments given
to the model's forward; the backend passes the step's `PagedStep` as `paged_step=`. An
implementation name absent from transformers' mask registry also makes transformers skip
building a dense causal mask, which the paged kernels do not need.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.models.attention import PagedStep, paged_layer_attention
from pagedserve.dataplane.models.base import CausalLM

ATTN_IMPLEMENTATION = "pagedserve"


class TransformersCausalLM(CausalLM):
    """A transformers causal LM (built with `attn_implementation=ATTN_IMPLEMENTATION`)."""

    implementation = "transformers"

    def __init__(self, hf_model: Any) -> None:
        super().__init__(hf_model.config, hf_model.dtype, getattr(hf_model, "generation_config", None))
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep) -> torch.Tensor:
        out = self.hf.get_decoder()(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            paged_step=step,
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def output_embeddings(self) -> nn.Module:
        head: nn.Module = self.hf.get_output_embeddings()
        return head


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry point.

    query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim] for the
    T new tokens of the flattened batch. Returns ([1, T, num_heads, head_dim], None).
    """
    step: PagedStep | None = kwargs.get("paged_step")
    if step is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the `paged_step` argument; "
            "run the model through pagedserve's ModelRunner"
        )
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [1, heads, T, D] -> [T, heads, D]
    out = paged_layer_attention(
        step, layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale
    )
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Register our attention with transformers (idempotent); returns the implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
