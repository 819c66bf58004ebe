"""The engine's start-up: load the model (`load_engine_model`), plan the KV pools
(`plan_kv`: the device pool's budget, an FP8 cache's scales, the host (swap) pool) and start
the runner with any tensor-parallel workers (`start_runner`).

The plans are functions of the settings and the loaded model, so `LLMEngine.__init__` reads
as the sequence of steps it takes and each plan is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.common.log import StartupPhases, get_logger
from pagedserve.common.models import resolve_model_path
from pagedserve.dataplane.config import DEFAULT_GPU_SWAP_SPACE_GIB, EngineConfig
from pagedserve.dataplane.kvcache.budget import (
    GpuMemoryPlan,
    KVCacheBudget,
    KVCacheShape,
    peak_activation_bytes,
    plan_gpu_memory,
    plan_kv_cache,
)
from pagedserve.dataplane.models import CausalLM
from pagedserve.dataplane.parallel.driver import TensorParallelDriver, WorkerLayout
from pagedserve.dataplane.parallel.group import threads_per_rank
from pagedserve.dataplane.parallel.sharding import check_divisible, shard_model
from pagedserve.dataplane.runner.kv_scales import KVScales, calibrate_kv_scales, calibration_token_ids
from pagedserve.dataplane.runner.memory_profile import CudaMemoryStats, profile_activation_peak
from pagedserve.dataplane.runner.model_loader import DTYPES, load_model, load_tokenizer, quantized_by
from pagedserve.dataplane.runner.model_runner import ModelRunner
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
    (dataplane/src/pagedserve/dataplane/runner/memory_profile.py); the estimate stands in only when that step runs
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


@dataclass(frozen=True)
class LoadedModel:
    """The model as the engine runs it, with what its checkpoint says about serving it."""

    model: CausalLM
    path: Path
    tokenizer: Any | None
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def load_engine_model(config: EngineConfig, phases: StartupPhases) -> LoadedModel:
    """Set torch's threads and seed, load the model and its tokenizer, and check what
    tensor parallelism needs of them."""
    tp = config.parallel.tensor_parallel_size
    if config.model.num_threads or tp > 1:
        torch.set_num_threads(threads_per_rank(config.model.num_threads, tp))
    torch.manual_seed(config.model.seed)
    path = resolve_model_path(config.model.model, config.model.model_home)
    quantized = quantized_by(path, config.model.quantization)
    if tp > 1 and quantized:
        raise ValueError(
            f"tensor_parallel_size {tp}: {quantized} runs on one rank so far (quantized weights "
            "are not split); use tensor_parallel_size 1"
        )
    tokenizer = load_tokenizer(path)
    m = config.model
    model = load_model(path, m.dtype, m.device, m.quantization, m.model_impl)
    phases.done("weights", model=str(path), dtype=m.dtype, implementation=model.implementation)
    if tp > 1:
        check_divisible(model.config, tp)
        if model.implementation != "pagedserve":
            raise ValueError(
                f"tensor_parallel_size {tp}: the model runs on transformers' modules, which are not "
                "split; tensor parallelism needs one of the owned architectures (Llama, Mistral, "
                "Qwen2, Qwen3) and model_impl auto"
            )
        if torch.device(m.device).type != "cpu":
            raise ValueError("tensor_parallel_size > 1 runs on the CPU (gloo) only so far")
    return LoadedModel(
        model,
        path,
        tokenizer,
        resolve_max_model_len(config, model.config),
        eos_token_ids(model.config, model.generation_config),
    )


@dataclass(frozen=True)
class KVPlan:
    """The device pool's budget and element type, an FP8 cache's scales, the host pool's size."""

    shape: KVCacheShape
    kv_dtype: torch.dtype
    budget: KVCacheBudget
    kv_scales: KVScales | None
    num_host_blocks: int


def plan_kv(config: EngineConfig, loaded: LoadedModel) -> KVPlan:
    """Plan the pools (logged). Per tensor-parallel rank: each rank's pool holds 1/tp of the
    KV heads, and the budget (kv_cache_memory, the blocks, the log) counts one rank's bytes."""
    tp = config.parallel.tensor_parallel_size
    hf, model, max_model_len = loaded.model.config, loaded.model, loaded.max_model_len
    kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, DTYPES[config.model.dtype])
    shape = KVCacheShape(
        num_layers=hf.num_hidden_layers,
        num_kv_heads=hf.num_key_value_heads // tp,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        bytes_per_element=kv_dtype.itemsize,
    )
    budget = plan_budget(config, shape, model, max_model_len)
    # The same budget in 16-bit and fp32 elements: an FP8 pool holds 2x and 4x their blocks.
    blocks_16, blocks_32 = budget.blocks_at(2), budget.blocks_at(4)
    log.info(
        "kv_cache_planned",
        tensor_parallel_size=tp,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        element_type=str(kv_dtype).removeprefix("torch."),
        blocks=budget.num_blocks,
        tokens=budget.num_tokens,
        bytes_per_token=shape.bytes_per_token,
        blocks_vs_16bit=round(budget.num_blocks / blocks_16, 3) if blocks_16 else None,
        blocks_vs_fp32=round(budget.num_blocks / blocks_32, 3) if blocks_32 else None,
        max_model_len=max_model_len,
        max_concurrency=round(budget.max_concurrency(max_model_len), 2),
        summary=budget.describe(max_model_len),
    )
    scales = None
    if config.cache.is_fp8:
        scales = plan_kv_scales(config, loaded.tokenizer, model, hf.num_hidden_layers, kv_dtype)
    num_host_blocks = plan_host_blocks(config, shape, budget)
    if num_host_blocks == 0 and config.scheduler.preemption_mode == "swap":
        raise ValueError(
            "preemption_mode='swap' needs a host pool: swap_space (or num_cpu_blocks_override) "
            f"leaves no room for a block of {shape.bytes_per_block(config.cache.block_size)} bytes"
        )
    log.info(
        "swap_space_planned",
        preemption_mode=config.scheduler.preemption_mode,
        host_blocks=num_host_blocks,
        host_bytes=num_host_blocks * shape.bytes_per_block(config.cache.block_size),
    )
    return KVPlan(shape, kv_dtype, budget, scales, num_host_blocks)


def start_runner(
    config: EngineConfig, model: CausalLM, plan: KVPlan
) -> tuple[ModelRunner, TensorParallelDriver | None]:
    """The runner over the planned pools. With tensor parallelism the workers start now,
    mirror this rank's block counts and scales, and run every forward with it (this rank
    alone schedules and samples); they are shut down if the runner cannot be built."""
    tp = config.parallel.tensor_parallel_size
    parallel = TensorParallelDriver(config) if tp > 1 else None
    try:
        if parallel is not None:
            layout = WorkerLayout.of(plan.budget.num_blocks, plan.num_host_blocks, plan.kv_scales)
            shard_model(model, parallel.connect(layout))
        runner = ModelRunner(
            model,
            config.model,
            plan.budget.num_blocks,
            config.cache.block_size,
            plan.kv_dtype,
            kv_scales=plan.kv_scales,
            num_host_blocks=plan.num_host_blocks,
            tensor_parallel_size=tp,
            step_listener=None if parallel is None else parallel.send,
        )
    except BaseException:
        if parallel is not None:
            parallel.shutdown()
        raise
    return runner, parallel
