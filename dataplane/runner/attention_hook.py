"""Our paged attention, plugged into transformers through its attention interface.

transformers' decoder layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with the projected, rotary-embedded q/k/v and pass through any extra keyword arguments
given to the model's forward. The runner passes one `PagedStep` per forward as
`paged_step=`; no global state is involved, so several engines can live in one process.
An implementation name that is absent from transformers' mask registry also makes
transformers skip building a dense causal mask, which the paged kernels do not need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kernels import AttentionMetadata, ResolvedBackends, paged_attention, write_kv_cache

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass(frozen=True)
class PagedStep:
    """What every layer's attention needs for one step: shared metadata plus per-layer caches."""

    metadata: AttentionMetadata
    # kv_caches[layer] = (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # The kernels' concrete implementations, resolved once for the caches (pagedserve.kernels.backend):
    # a layer call only dispatches on them.
    backends: ResolvedBackends
    # kv_scales[layer] = (k_scale, v_scale) of an FP8 cache; None: the cache is in the model dtype.
    kv_scales: list[tuple[float, float]] | None = None
    # Called with (layer, key, value) of the step's new tokens before they are cached
    # (KV-scale calibration); key/value: [T, num_kv_heads, head_dim].
    observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = field(default=None, compare=False)


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


def paged_layer_attention(
    step: PagedStep, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One layer's attention for the step: cache the new k/v, attend over the paged context.

    q: [T, H, D]; k, v: [T, KVH, D] (any strides with head_dim contiguous), already rotary-
    embedded. Returns a new contiguous [T, H, D]. Shared by the transformers hook above and
    the fused layers (dataplane/runner/fused_layers.py).
    """
    key_cache, value_cache = step.kv_caches[layer_idx]
    if step.observer is not None:
        step.observer(layer_idx, k, v)
    k_scale, v_scale = step.kv_scales[layer_idx] if step.kv_scales is not None else (1.0, 1.0)
    write_kv_cache(
        k,
        v,
        key_cache,
        value_cache,
        step.metadata.slot_mapping,
        k_scale,
        v_scale,
        impl=step.backends.cache_write,
    )
    return paged_attention(
        q,
        key_cache,
        value_cache,
        step.metadata,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        impl=step.backends.attention,
    )


def register_paged_attention() -> str:
    """Register our attention with transformers (idempotent); returns the implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
