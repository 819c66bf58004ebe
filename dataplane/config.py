"""Engine configuration: frozen dataclasses, one place. Imports no torch.

Flag names follow vLLM's where vLLM has one (`--max-num-seqs`, `--block-size`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class CacheConfig:
    """Shape and size of the paged KV cache.

    On the CPU the pool is sized by `kv_cache_memory` bytes; on a GPU by
    `gpu_memory_utilization` of device memory minus weights and peak activations.
    `num_blocks_override` pins the block count (tests use tiny pools).

    With `enable_prefix_caching`, full blocks are kept after their requests end, under a
    chained hash seeded by `prefix_hash_seed` (docs/prefix-hash.md); a control plane that
    computes hashes must use the same seed. `enable_kv_events` records the pool's KV events
    for whoever streams them to an external prefix index (it must drain them every step).
    """

    block_size: int = 16
    kv_cache_memory: int = 2 * 1024**3
    gpu_memory_utilization: float = 0.90
    kv_cache_dtype: str = "auto"
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_hash_seed: str = "pagedserve"
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported yet; use 'auto'")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")
        for name in ("enable_prefix_caching", "enable_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.prefix_hash_seed, str) or not self.prefix_hash_seed:
            raise ValueError(f"prefix_hash_seed must be a non-empty string, got {self.prefix_hash_seed!r}")
        if self.enable_kv_events and not self.enable_prefix_caching:
            raise ValueError(
                "enable_kv_events needs enable_prefix_caching: without it there is nothing to report"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits. `max_model_len` None means: take the model's own limit."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how. `model` is a store name or a local Hugging Face folder."""

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
