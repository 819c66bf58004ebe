"""Engine configuration: frozen dataclasses, one place. Imports no torch.

Flag names follow vLLM's where vLLM has one (`--max-num-seqs`, `--block-size`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Same names as kernels.fp8.KV_CACHE_DTYPES (this module imports no torch).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("torch", "triton")


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

    `kv_cache_dtype` "auto" stores K/V in the model's dtype; "fp8_e4m3" / "fp8_e5m2" store
    1 byte per element with per-layer K and V scales, read from `kv_scales_path` (JSON, see
    dataplane/runner/kv_scales.py) when given, else calibrated at start-up when
    `calculate_kv_scales`, else 1.0 (with a loud warning).
    """

    block_size: int = 16
    kv_cache_memory: int = 2 * 1024**3
    gpu_memory_utilization: float = 0.90
    kv_cache_dtype: str = "auto"
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_hash_seed: str = "pagedserve"
    enable_kv_events: bool = False
    calculate_kv_scales: bool = True
    kv_scales_path: str | None = None

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_scales_path is not None and not self.is_fp8:
            raise ValueError("kv_scales_path needs an FP8 kv_cache_dtype (fp8_e4m3 or fp8_e5m2)")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")
        for name in ("enable_prefix_caching", "enable_kv_events", "calculate_kv_scales"):
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
    """Which weights to run and how. `model` is a store name or a local Hugging Face folder.

    `attention_backend` None picks the kernels by device: Triton on CUDA, the torch/C++
    path on the CPU. "triton" on the CPU needs TRITON_INTERPRET=1 (tests only).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS} (or None: by device), "
                f"got {self.attention_backend!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
