"""The KV memory budget: how many KV blocks fit, and what that buys. Imports no torch.

KV memory = device memory x gpu_memory_utilization - weights - peak activations (GPU), or
`kv_cache_memory` bytes (CPU): the usual budget, as vLLM's `gpu_memory_utilization` defines it
(the share of the device the whole process may take, weights and activations included; see
https://docs.vllm.ai/en/latest/configuration/engine_args/ and docs/capacity-planning.md).
blocks = KV memory / (2 x layers x block_size x kv_heads x head_dim x bytes per element).
max concurrency = blocks x block_size / tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per KV element for each `kv_cache_dtype` (and the model dtypes `auto` resolves to).
KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class KVCacheShape:
    """One pool's KV geometry. Under tensor parallelism each rank's pool holds its share of
    the KV heads: `num_kv_heads` is then one rank's count, and every byte figure is per rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: int

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


@dataclass(frozen=True)
class KVCacheBudget:
    shape: KVCacheShape
    block_size: int
    kv_memory_bytes: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_at(self, bytes_per_element: int) -> int:
        """Blocks the same memory would hold at another element size (an FP8 pool vs a
        16-bit one: 2x; vs fp32: 4x, exactly when the memory is a multiple of the blocks)."""
        shape = KVCacheShape(
            self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim, bytes_per_element
        )
        return self.kv_memory_bytes // shape.bytes_per_block(self.block_size)

    def max_concurrency(self, tokens_per_request: int) -> float:
        """Requests of `tokens_per_request` tokens each that fit at once (blocks x block_size / tokens)."""
        return self.num_tokens / tokens_per_request

    def describe(self, max_model_len: int) -> str:
        return (
            f"KV cache: {self.kv_memory_bytes / 2**20:.0f} MiB, {self.shape.bytes_per_token} B/token -> "
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens; "
            f"max concurrency {self.max_concurrency(max_model_len):.2f} requests at max_model_len={max_model_len}"
        )


def kv_memory_on_gpu(
    total_bytes: int, gpu_memory_utilization: float, weight_bytes: int, activation_bytes: int
) -> int:
    """total x gpu_memory_utilization - weights - activations; raises ValueError when nothing is
    left for the KV cache."""
    available = int(total_bytes * gpu_memory_utilization) - weight_bytes - activation_bytes
    if available <= 0:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV cache "
            f"(total {total_bytes}, weights {weight_bytes}, activations {activation_bytes} bytes)"
        )
    return available


def peak_activation_bytes(
    max_num_batched_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    bytes_per_element: int,
    max_num_seqs: int,
    vocab_size: int,
) -> int:
    """Peak activations of the largest step: hidden states and MLP intermediates of every batched
    token, plus fp32 logits for up to `max_num_seqs` sampled rows. An estimate, not a profile."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * bytes_per_element
    return max_num_batched_tokens * per_token + max_num_seqs * vocab_size * 4


def plan_kv_cache(shape: KVCacheShape, block_size: int, kv_memory_bytes: int) -> KVCacheBudget:
    """Blocks that fit in `kv_memory_bytes`; raises ValueError if not even one does."""
    num_blocks = kv_memory_bytes // shape.bytes_per_block(block_size)
    if num_blocks < 1:
        raise ValueError(
            f"KV memory of {kv_memory_bytes} bytes holds no block of {shape.bytes_per_block(block_size)} bytes; "
            "raise kv_cache_memory"
        )
    return KVCacheBudget(shape, block_size, kv_memory_bytes, num_blocks)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """Each term of the GPU KV budget, for the start-up log (`log_fields`).

    kv = total x utilization - weights - activation peak - non-torch memory, and at most what
    is free now less the activation peak (the step's activations were freed after the profile
    but will be needed again; another process may hold part of the device).
    """

    total_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    activation_peak_bytes: int
    activation_source: str  # "profiled" (a measured step) or "estimated" (peak_activation_bytes)
    non_torch_bytes: int
    free_bytes: int
    kv_memory_bytes: int

    @property
    def capped_by_free(self) -> bool:
        """True when free memory, not the utilization share, set the KV size."""
        share = int(self.total_bytes * self.gpu_memory_utilization)
        formula = share - self.weight_bytes - self.activation_peak_bytes - self.non_torch_bytes
        return self.kv_memory_bytes < formula

    def log_fields(self) -> dict[str, int | float | str | bool]:
        return {
            "total": self.total_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights": self.weight_bytes,
            "activation_peak": self.activation_peak_bytes,
            "activation_source": self.activation_source,
            "non_torch": self.non_torch_bytes,
            "free": self.free_bytes,
            "kv_bytes": self.kv_memory_bytes,
            "capped_by_free": self.capped_by_free,
        }


def plan_gpu_memory(
    total_bytes: int,
    gpu_memory_utilization: float,
    weight_bytes: int,
    activation_peak_bytes: int,
    non_torch_bytes: int,
    free_bytes: int,
    activation_source: str = "profiled",
) -> GpuMemoryPlan:
    """The GPU budget (`kv_memory_on_gpu`) with every term (GpuMemoryPlan); raises ValueError naming
    gpu_memory_utilization, or the free memory, when nothing is left for the KV cache."""
    formula = kv_memory_on_gpu(
        total_bytes, gpu_memory_utilization, weight_bytes, activation_peak_bytes + non_torch_bytes
    )
    room = free_bytes - activation_peak_bytes
    if room <= 0:
        raise ValueError(
            f"only {free_bytes} bytes of device memory are free, not even the activation peak "
            f"of {activation_peak_bytes} bytes; another process holds the rest"
        )
    return GpuMemoryPlan(
        total_bytes,
        gpu_memory_utilization,
        weight_bytes,
        activation_peak_bytes,
        activation_source,
        non_torch_bytes,
        free_bytes,
        min(formula, room),
    )
