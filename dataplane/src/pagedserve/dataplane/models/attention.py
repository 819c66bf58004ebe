"""One layer's paged attention for a step, and the step's shared inputs (`PagedStep`).

The owned models (dataplane/src/pagedserve/dataplane/models/llama.py) call `paged_layer_attention` from each decoder
layer; the transformers backend reaches it through transformers' attention interface
(dataplane/src/pagedserve/dataplane/models/transformers_backend.py). The runner builds one `PagedStep` per forward and
passes it down explicitly: no global state, so several engines can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.kernels import AttentionMetadata, ResolvedBackends, paged_attention, write_kv_cache


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


def paged_layer_attention(
    step: PagedStep, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One layer's attention for the step: cache the new k/v, attend over the paged context.

    q: [T, H, D]; k, v: [T, KVH, D] (any strides with head_dim contiguous), already rotary-
    embedded. Returns a new contiguous [T, H, D]. Shared by the owned decoder layers and
    the transformers backend's attention hook.
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
