"""The engine's start-up planning: the context limit, the end-of-sequence ids, an FP8 cache's
scales, and the KV budget of the device pool and the host (swap) pool.

Pure functions of the settings and the loaded model, so `LLMEngine.__init__` reads as the
sequence of steps it takes and each plan is tested on its own.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.common.log import get_logger
from pagedserve.dataplane.config import DEFAULT_GPU_SWAP_SPACE_GIB, EngineConfig
from pagedserve.dataplane.kvcache.budget import (
    GpuMemoryPlan,
    KVCacheBudget,
    KVCacheShape,
    peak_activation_bytes,
    plan_gpu_memory,
    plan_kv_cache,
)
from pagedserve.dataplane.runner.kv_scales import KVScales, calibrate_kv_scales, calibration_token_ids
from pagedserve.dataplane.runner.memory_profile import CudaMemoryStats, profile_activation_peak
from pagedserve.dataplane.runner.model_loader import DTYPES
from pagedserve.kernels import kv_cache_torch_dtype

log = get_logger(__name__)


def resolve_max_model_len(config: EngineConfig, hf: Any) -> int:
    """The context limit: the one asked for, checked against the model's (and its sliding
    window's), else the model's own."""
    limit = int(getattr(hf, "max_position_embeddings", 0) or 0) or None
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", True):
        # Our kernels attend to the whole context; past the window the model would differ.
        limit = min(limit, int(window)) if limit else int(window)
    asked = config.scheduler.max_model_len
    if asked is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return limit
    if limit is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's limit of {limit} tokens")
    return asked


def eos_token_ids(hf: Any, gen_cfg: Any) -> tuple[int, ...]:
    """The end-of-sequence ids of the generation config and the model config, in order, once each."""
    ids: list[int] = []
    for source in (gen_cfg, hf):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.extend(value if isinstance(value, list) else [value])
    return tuple(dict.fromkeys(int(i) for i in ids))


def plan_kv_scales(
    config: EngineConfig, tokenizer: Any, model: Any, num_layers: int, fp8: torch.dtype
) -> KVScales:
    """An FP8 cache's per-layer scales: the scales file, else calibration, else 1.0 (warned)."""
    cache = config.cache
    if cache.kv_scales_path is not None:
        scales = KVScales.load(cache.kv_scales_path, num_layers, cache.kv_cache_dtype)
    elif cache.calculate_kv_scales:
        ids = calibration_token_ids(tokenizer, model.config.vocab_size)
        scales = calibrate_kv_scales(model, ids, fp8, cache.block_size)
    else:
        scales = KVScales.ones(num_layers)
        log.warning(
            "kv_scales_default_1_0",
            message=(
                f"!!! kv_cache_dtype={cache.kv_cache_dtype} with K/V scales 1.0 for every layer: no "
                "--kv-scales-path and --no-calculate-kv-scales. Values beyond the FP8 range "
                "saturate and small ones lose precision; expect degraded outputs. !!!"
            ),
        )
    log.info(
        "kv_scales",
        kv_cache_dtype=cache.kv_cache_dtype,
        source=scales.source,
        k_scale_range=(round(min(scales.k_scale), 6), round(max(scales.k_scale), 6)),
        v_scale_range=(round(min(scales.v_scale), 6), round(max(scales.v_scale), 6)),
    )
    return scales


def plan_budget(config: EngineConfig, shape: KVCacheShape, model: Any, max_model_len: int) -> KVCacheBudget:
    """The device pool's budget: pinned by num_gpu_blocks_override, else kv_cache_memory on the
    CPU, else what the GPU has left once weights and the profiled activation peak are counted."""
    cache = config.cache
    if cache.num_gpu_blocks_override is not None:
        memory = cache.num_gpu_blocks_override * shape.bytes_per_block(cache.block_size)
        return plan_kv_cache(shape, cache.block_size, memory)
    device = torch.device(config.model.device)
    if device.type != "cuda":
        return plan_kv_cache(shape, cache.block_size, cache.kv_cache_memory)
    gpu, profile_fields = plan_device_memory(config, model, device, max_model_len)
    budget = plan_kv_cache(shape, cache.block_size, gpu.kv_memory_bytes)
    log.info("gpu_memory_planned", **gpu.log_fields(), **profile_fields, blocks=budget.num_blocks)
    return budget


def plan_device_memory(
    config: EngineConfig, model: Any, device: torch.device, max_model_len: int
) -> tuple[GpuMemoryPlan, dict[str, int]]:
    """The GPU budget's terms, the activation peak measured by running the worst-case step
    (dataplane/runner/memory_profile.py); the estimate stands in only when that step runs
    out of memory. Also the profile's own figures, for the start-up log."""
    cache, sched, hf = config.cache, config.scheduler, model.config
    dtype = DTYPES[config.model.dtype]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = peak_activation_bytes(
        sched.max_num_batched_tokens,
        hf.hidden_size,
        hf.intermediate_size,
        dtype.itemsize,  # activations are in the model dtype
        sched.max_num_seqs,
        hf.vocab_size,
    )
    try:
        profile = profile_activation_peak(
            model,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=max_model_len,
            block_size=cache.block_size,
            kv_dtype=kv_cache_torch_dtype(cache.kv_cache_dtype, dtype),
            device=device,
            stats=CudaMemoryStats(device),
            attention_backend=config.model.attention_backend,
        )
    except torch.cuda.OutOfMemoryError as exc:
        log.warning(
            "memory_profile_out_of_memory",
            error=str(exc).splitlines()[0],
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            fallback="estimated activation peak",
        )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        plan = plan_gpu_memory(total, cache.gpu_memory_utilization, weights, estimate, 0, free, "estimated")
        return plan, {"activation_estimate": estimate}
    plan = plan_gpu_memory(
        profile.total_bytes,
        cache.gpu_memory_utilization,
        weights,
        profile.activation_peak_bytes,
        profile.non_torch_bytes,
        profile.free_bytes,
    )
    fields = {
        "activation_estimate": estimate,
        "profile_seqs": profile.num_seqs,
        "profile_tokens": profile.num_tokens,
        "profile_pool": profile.profile_pool_bytes,
    }
    return plan, fields


def plan_host_blocks(config: EngineConfig, shape: KVCacheShape, budget: KVCacheBudget) -> int:
    """Blocks of the host (swap) pool: none when preemption never swaps; else pinned by
    num_cpu_blocks_override, else swap_space GiB, else the default (CacheConfig): 4 GiB
    next to a GPU, the device pool's own bytes on the CPU.

    Why that much on the CPU: a host pool too small for the victims of a pressure spike
    makes auto fall back to recompute (a quarter of the device pool re-did 10 % of the
    tokens of `pagedserve bench pressure`; the same bytes, none). Its tensors are
    allocated with torch.empty, so only the pages swap-outs write are committed: it costs
    address space until preemption by swap actually happens."""
    cache = config.cache
    if config.scheduler.preemption_mode == "recompute":
        return 0
    if cache.num_cpu_blocks_override is not None:
        return cache.num_cpu_blocks_override
    if cache.swap_space is not None:
        memory = int(cache.swap_space * 2**30)
    elif torch.device(config.model.device).type == "cuda":
        memory = int(DEFAULT_GPU_SWAP_SPACE_GIB * 2**30)
    else:
        memory = budget.kv_memory_bytes
    return memory // shape.bytes_per_block(cache.block_size)
