"""The activation peak of the largest step, measured by running it: what sizes the KV pool on CUDA.

Why measure rather than estimate (kvcache.budget.peak_activation_bytes): the estimate counts
hidden states, MLP intermediates and the logits, but not the attention kernels' scratch
(split-KV partials), the sampler's sort over the vocabulary, cuBLAS workspaces or the caching
allocator's rounding. Running the worst-case step once through the real model, our paged
attention and the sampler counts all of them.

The worst case (as vLLM profiles it): `max_num_batched_tokens` prompt tokens spread evenly over
`min(max_num_seqs, max_num_batched_tokens)` new sequences, each computed whole in this one step,
so every sequence samples a row (the LM head and the sampler run at their largest batch), with
top-k/top-p/min-p filtering and logprobs: the sampler's most memory-hungry path. The step writes
its KV into a temporary pool just large enough for it, which is freed with everything else
before the real pool is allocated.

Memory figures come from a `MemoryStats` provider: `CudaMemoryStats` on a GPU; tests inject a
fake one so the code path and its arithmetic run on the CPU.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.dataplane.config import ModelConfig
from pagedserve.dataplane.kvcache import cdiv
from pagedserve.dataplane.request import Request
from pagedserve.dataplane.runner.kv_scales import KVScales
from pagedserve.dataplane.runner.model_runner import ModelRunner
from pagedserve.dataplane.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.kernels.fp8 import is_fp8

# Sampling with every filter on and logprobs: sorts and normalises [rows, vocab] fp32 tensors.
PROFILE_SAMPLING = SamplingParams(
    max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS, seed=0
)


class MemoryStats(Protocol):
    """The allocator and device figures a profile reads (torch.cuda's, or a test's fake)."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, whoever uses them."""
        ...

    def memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int:
        """Bytes torch's caching allocator holds (allocated or cached)."""
        ...

    def reset_peak_memory_stats(self) -> None: ...

    def max_memory_allocated(self) -> int:
        """The highest `memory_allocated` since the last reset."""
        ...


class CudaMemoryStats:
    """torch.cuda's figures for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


@dataclass(frozen=True)
class ActivationProfile:
    """What the worst-case step measured.

    `activation_peak_bytes`: the highest allocation above the baseline (model and temporary
    pool in place) during the step. `non_torch_bytes`: device memory outside torch's allocator
    that appeared during the profile (cuBLAS handles, loaded kernels), which stays.
    `free_bytes`/`total_bytes`: the device after everything the profile made was freed.
    """

    num_seqs: int
    num_tokens: int
    activation_peak_bytes: int
    profile_pool_bytes: int
    non_torch_bytes: int
    free_bytes: int
    total_bytes: int


def worst_case_seq_lens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Token counts of the profiled sequences: `max_num_batched_tokens` (at most what
    `max_model_len` lets the sequences hold) spread as evenly as possible, longest first."""
    for name, value in (
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    total = min(max_num_batched_tokens, num_seqs * max_model_len)
    base, extra = divmod(total, num_seqs)
    return [base + 1] * extra + [base] * (num_seqs - extra)


def dummy_scheduler_output(
    seq_lens: list[int], block_size: int, vocab_size: int
) -> tuple[SchedulerOutput, int]:
    """One step computing every sequence whole (so each samples), and the blocks it needs:
    sequence i owns the next cdiv(len, block_size) block ids of a pool numbered from 0."""
    out = SchedulerOutput()
    next_block = 0
    for i, length in enumerate(seq_lens):
        # Token ids cycle through the vocabulary; their values do not change the memory used.
        tokens = [(i + j) % vocab_size for j in range(length)]
        request = Request(f"memory-profile-{i}", tokens, PROFILE_SAMPLING)
        blocks = cdiv(length, block_size)
        request.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        out.scheduled.append(ScheduledRequest(request, length))
    return out, next_block


def _non_torch_bytes(stats: MemoryStats) -> int:
    """Device memory in use outside torch's allocator (the CUDA context, other libraries'
    buffers, other processes)."""
    free, total = stats.mem_get_info()
    return total - free - stats.memory_reserved()


def profile_activation_peak(
    model: Any,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    stats: MemoryStats,
    attention_backend: str | None = None,
) -> ActivationProfile:
    """Run the worst-case step (module docstring) on a temporary pool and measure its peak.

    Leaves the device as it found it: the temporary runner, its pool and the step's tensors
    are dropped and torch's cache is emptied before the figures after it are read.
    """
    seq_lens = worst_case_seq_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    out, num_blocks = dummy_scheduler_output(seq_lens, block_size, model.config.vocab_size)
    num_layers = model.config.num_hidden_layers
    # Scale values do not change the memory used; an FP8 pool just needs some.
    scales = KVScales.ones(num_layers) if is_fp8(kv_dtype) else None
    stats.synchronize()
    stats.empty_cache()
    non_torch_before = _non_torch_bytes(stats)
    config = ModelConfig(device=str(device), attention_backend=attention_backend)
    runner = ModelRunner(model, config, num_blocks, block_size, kv_dtype, kv_scales=scales)
    try:
        pool_bytes = sum(t.numel() * t.element_size() for kv in runner.kv_caches for t in kv)
        stats.synchronize()
        baseline = stats.memory_allocated()
        stats.reset_peak_memory_stats()
        sampled = runner.execute(out)
        stats.synchronize()
        peak = stats.max_memory_allocated() - baseline
        if len(sampled) != len(seq_lens):
            raise RuntimeError(f"the profiled step sampled {len(sampled)} of {len(seq_lens)} sequences")
    finally:
        del runner
        gc.collect()
        stats.empty_cache()
        stats.synchronize()
    free, total = stats.mem_get_info()
    return ActivationProfile(
        num_seqs=len(seq_lens),
        num_tokens=sum(seq_lens),
        activation_peak_bytes=max(0, peak),
        profile_pool_bytes=pool_bytes,
        non_torch_bytes=max(0, _non_torch_bytes(stats) - non_torch_before),
        free_bytes=free,
        total_bytes=total,
    )
