"""Engine configuration: frozen dataclasses, one place. Imports no torch.

Each field is declared once with its default and help (`setting`); flag names follow vLLM's
where vLLM has one (`--max-num-seqs`, `--block-size`, ...). To add an engine setting, add a
field here: the flags, `LLM(...)` and the data plane `serve` starts pick it up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common import settings
from pagedserve.common.block_hash import DEFAULT_HASH_SEED
from pagedserve.common.env import MODEL_HOME_HELP
from pagedserve.common.lifecycle import is_loopback
from pagedserve.common.models.store import DEFAULT_MODEL
from pagedserve.common.settings import check_bounds, format_bytes, parse_bytes, setting
from pagedserve.dataplane.speculative.config import SpeculativeConfig
from pagedserve.kernels.names import BACKENDS, KV_CACHE_DTYPES

# The kernels' own vocabulary (pagedserve.kernels.names is a torch-free leaf: so is this module).
ATTENTION_BACKENDS = BACKENDS
MODEL_DTYPES = ("float32", "bfloat16", "float16")
# How fp32 CPU linears pick their kernel (dataplane/src/pagedserve/dataplane/runner/linear_selection.py).
CPU_LINEAR_MODES = ("auto", "panel", "onednn")
# What the panel kernel holds an fp32 CPU model's linear weights in.
CPU_WEIGHT_DTYPES = ("float32", "bfloat16")
# Quantize a float checkpoint's linear weights at load (dataplane/src/pagedserve/dataplane/runner/quant_linear.py).
QUANTIZATIONS = ("int8",)
QUANTIZED_MATMULS = ("auto", "int8", "float32")
# Which forward runs the model: the owned Llama family where it applies, else transformers'
# (dataplane/src/pagedserve/dataplane/models/from_transformers.py); vLLM's `--model-impl`.
MODEL_IMPLS = ("auto", "pagedserve", "transformers")
# How the scheduler preempts a running sequence when the device KV pool runs out (scheduler.py).
PREEMPTION_MODES = ("auto", "swap", "recompute")
# swap_space left unset next to a GPU: 4 GiB of host memory, vLLM's `--swap-space` default.
DEFAULT_GPU_SWAP_SPACE_GIB = 4.0


@dataclass(frozen=True)
class CacheConfig:
    """Shape and size of the paged KV cache.

    On the CPU the pool is sized by `kv_cache_memory` bytes; on a GPU by
    `gpu_memory_utilization` of device memory minus weights and peak activations.
    `num_gpu_blocks_override` pins the block count (tests use tiny pools).

    With `enable_prefix_caching`, full blocks are kept after their requests end, under a
    chained hash seeded by `prefix_hash_seed` (docs/prefix-hash.md); a control plane that
    computes hashes must use the same seed. `enable_kv_events` records the pool's KV events
    for whoever streams them to an external prefix index (it must drain them every step).

    `swap_space` (GiB of host memory per data plane) sizes the host-side block pool that
    preemption by swap copies a victim's blocks into. Left unset it is 4 GiB next to a
    GPU (vLLM's default), and on the CPU the device pool's own bytes (2GiB at the default
    kv_cache_memory). The host pool is allocated with torch.empty: only the pages swap-outs
    write are committed, so it costs address space until preemption by swap happens, then up
    to that many bytes of RAM more (written pages stay resident). Smaller, it fills under a
    pressure spike and auto falls back to recompute (a quarter of the device pool re-did 10 %
    of the tokens of `pagedserve bench pressure`, the same bytes none); set swap_space to
    bound the process's memory (0: never swap). `num_cpu_blocks_override` pins the host
    pool's block count instead (tests); with preemption_mode "recompute" no host pool is
    allocated.

    `kv_cache_dtype` "auto" stores K/V in the model's dtype; "bfloat16" rounds an fp32
    model's K/V to bf16 (half the bytes and twice the blocks; decode attention, bound by
    memory bandwidth, reads half as much); "fp8_e4m3" / "fp8_e5m2" store
    1 byte per element with per-layer K and V scales, read from `kv_scales_path` (JSON, see
    dataplane/src/pagedserve/dataplane/runner/kv_scales.py) when given, else calibrated at start-up when
    `calculate_kv_scales`, else 1.0 (with a loud warning).
    """

    block_size: int = setting(16, "tokens per KV block", minimum=1)
    kv_cache_memory: int = setting(
        2 * 1024**3,
        "KV pool size on the CPU (e.g. 2GiB, 512MiB)",
        parse=parse_bytes,
        show=format_bytes,
        minimum=1,
    )
    gpu_memory_utilization: float = setting(
        0.90, "fraction of GPU memory for weights, activations and KV", exclusive_minimum=0, maximum=1
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache element type: auto (the model dtype), bfloat16 (an fp32 model's K/V rounded to bf16: "
        "2x the blocks, half the bytes read per decode step) or FP8 (1 byte per element, 2x the blocks of 16-bit)",
        choices=KV_CACHE_DTYPES,
    )
    num_gpu_blocks_override: int | None = setting(
        None,
        "pin the KV pool's block count (default: sized from --kv-cache-memory on the CPU, "
        "from --gpu-memory-utilization on a GPU)",
        minimum=1,
    )
    swap_space: float | None = setting(
        None,
        "host memory in GiB per data plane for swapped-out KV blocks (default: 4 on a GPU; on the CPU, "
        "the device KV pool's bytes, committed only as swap-outs write them)",
        minimum=0,
    )
    num_cpu_blocks_override: int | None = setting(
        None,
        "pin the host (swap) pool's block count (overrides swap_space; 0: no swapping) "
        "(default: sized from --swap-space)",
        minimum=0,
    )
    enable_prefix_caching: bool = setting(True, "reuse cached prompt blocks")
    prefix_hash_seed: str = setting(DEFAULT_HASH_SEED, "seed of the chained block hashes", min_length=1)
    enable_kv_events: bool = setting(
        False, "record KV events for an external prefix index (the data plane turns it on)", cli=False
    )
    calculate_kv_scales: bool = setting(
        True, "FP8 cache: calibrate per-layer K/V scales at start-up (else 1.0, with a warning)"
    )
    kv_scales_path: str | None = setting(
        None,
        "FP8 cache: JSON file of per-layer K/V scales (overrides calibration) "
        "(default: none, calibrated per --calculate-kv-scales)",
    )

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_scales_path is not None and not self.is_fp8:
            raise ValueError("kv_scales_path needs an FP8 kv_cache_dtype (fp8_e4m3 or fp8_e5m2)")
        for name in ("enable_prefix_caching", "enable_kv_events", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.enable_kv_events and not self.enable_prefix_caching:
            raise ValueError(
                "enable_kv_events needs enable_prefix_caching: without it there is nothing to report"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits. `max_model_len` None means: take the model's own limit.

    When the device KV pool runs out the scheduler preempts the most recently admitted
    running sequence: by swap (its blocks copied to the host pool, progress kept) or by
    recompute (its blocks freed, recomputed later from its tokens and cached prefix blocks).
    `preemption_mode` "auto" picks per victim whichever its estimated cost makes cheaper;
    "swap" swaps whenever the host pool has room (else recomputes); "recompute" never swaps.
    New work and swapped-out work resume only while `watermark` of the device blocks stay
    free afterwards, so that an admission does not immediately cause a preemption.
    """

    max_num_seqs: int = setting(64, "most sequences in one batch", minimum=1)
    max_num_batched_tokens: int = setting(2048, "most tokens (prefill and decode) in one step", minimum=1)
    max_prefill_tokens_while_decoding: int | None = setting(
        None,
        "most prompt tokens a step computes while other requests are decoding (a burst of new "
        "requests then prefills over several steps): bounds the running streams' inter-token "
        "gaps at the cost of the newcomers' time to first token (default: no bound beyond "
        "max_num_batched_tokens)",
        minimum=1,
    )
    prefill_stretch: float = setting(
        0.0,
        "while requests decode, the prompt tokens a step computes may stretch it by at most "
        "this many decode-only steps (both timed as the engine runs), so a burst of new "
        "requests prefills over several steps instead of stalling the running streams; it "
        "costs the newcomers' time to first token about (1 + stretch) / stretch of their "
        "prefill (0: off)",
        minimum=0,
        maximum=1000,
    )
    max_model_len: int | None = setting(
        None, "longest prompt plus output (default: the model's limit)", minimum=1
    )
    preemption_mode: str = setting(
        "auto",
        "how to preempt when the KV pool runs out: swap to host memory, recompute later, or auto "
        "(per victim, whichever is estimated cheaper)",
        choices=PREEMPTION_MODES,
    )
    watermark: float = setting(
        0.01,
        "fraction of the KV blocks kept free when admitting or resuming work (0: none)",
        minimum=0,
        exclusive_maximum=1,
    )
    structured_outputs_compile_timeout: float = setting(
        10.0,
        "seconds a structured-output grammar (JSON schema, regex, choice, EBNF) may take to "
        "compile; past it the request fails with INVALID_ARGUMENT naming the field",
        exclusive_minimum=0,
        maximum=3600,
    )

    speculative_config: str | None = setting(
        None,
        'speculative decoding as JSON in vLLM\'s shape, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
        "(default: off; methods: ngram, suffix)",
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: speculative decoding is off)."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how. `model` is a store name or a local Hugging Face folder.

    `attention_backend` None picks the kernels by device: Triton on CUDA, the torch/C++
    path on the CPU. "triton" on the CPU needs TRITON_INTERPRET=1 (tests only).
    """

    model: str = setting(DEFAULT_MODEL, "store name, local Hugging Face folder or .gguf file")
    model_home: str | None = setting(None, MODEL_HOME_HELP)
    dtype: str = setting("float32", "weights and activations dtype", choices=MODEL_DTYPES)
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    seed: int = setting(0, "seed of the random sampling state")
    num_threads: int | None = setting(
        None,
        "torch intra-op threads (default: torch's own, split evenly across tensor-parallel ranks)",
        flag="--threads",
        minimum=1,
    )
    attention_backend: str | None = setting(
        None,
        "attention kernels (default: triton on CUDA, torch on CPU; triton on CPU needs TRITON_INTERPRET=1)",
        choices=ATTENTION_BACKENDS,
    )

    model_impl: str = setting(
        "auto",
        "model implementation: pagedserve's own forward (the Llama family: Llama, Mistral, Qwen2, "
        "Qwen3), transformers' modules with our paged attention, or auto (ours where it applies, "
        "else transformers')",
        choices=MODEL_IMPLS,
    )

    cpu_linear: str = setting(
        "auto",
        "fp32 CPU linear kernels: auto times ours against oneDNN per shape and row band at load "
        "(cached per CPU); panel or onednn forces one",
        choices=CPU_LINEAR_MODES,
    )

    cpu_weight_dtype: str = setting(
        "float32",
        "fp32 CPU models: what the panel kernel holds linear weights in; bfloat16 halves their bytes "
        "(AVX-512 BF16 dot products where the CPU has them), activations and KV cache stay fp32",
        choices=CPU_WEIGHT_DTYPES,
    )

    quantization: str | None = setting(
        None,
        "quantize the linear weights at load: int8 (per output channel, symmetric; CPU, float32 "
        "activations); a GGUF model's weights stay as its file has them (default: none, the "
        "checkpoint's own weights)",
        choices=QUANTIZATIONS,
    )

    quantized_matmul: str = setting(
        "auto",
        "quantized models (GGUF, --quantization int8) on the CPU: int8 rounds each activation row "
        "to int8 per block of 32 inputs and sums integer dot products (as llama.cpp does; AVX-512 "
        "VNNI or AVX2); float32 de-quantizes the weights in registers, bit-identical to the fp32 "
        "model on the de-quantized weights; auto is int8 where the kernels have integer dot "
        "products (AVX2 or better), else float32",
        choices=QUANTIZED_MATMULS,
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        # (Its dtype and device are checked where the model loads, as a GGUF model's are.)
        if self.quantized_matmul not in QUANTIZED_MATMULS:
            raise ValueError(
                f"quantized_matmul must be one of {QUANTIZED_MATMULS}, got {self.quantized_matmul!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}"
            )
        if self.cpu_weight_dtype not in CPU_WEIGHT_DTYPES:
            raise ValueError(
                f"cpu_weight_dtype must be one of {CPU_WEIGHT_DTYPES}, got {self.cpu_weight_dtype!r}"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, got {self.cpu_linear!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS} (or None: by device), "
                f"got {self.attention_backend!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run one model. `tensor_parallel_size` N > 1 splits every decoder
    layer's attention heads and MLP across N processes (Megatron style: column-parallel q/k/v
    and gate/up, row-parallel o and down with one all-reduce each) in one torch.distributed
    group (gloo on the CPU). Rank 0 is the engine: it schedules, broadcasts each step's plan
    and samples; ranks 1..N-1 are workers it starts and supervises (dataplane/src/pagedserve/dataplane/parallel/).

    Each rank holds 1/N of the KV heads, so `kv_cache_memory` is per rank: the same bytes hold
    N times the blocks. With `num_threads` unset each rank takes 1/N of torch's threads, so N
    ranks share the cores instead of oversubscribing them. The model's attention and KV head
    counts must divide by N (checked when the engine loads the model).
    """

    tensor_parallel_size: int = setting(
        1, "processes that split each layer's heads and MLP (gloo on the CPU); 1: no split", minimum=1
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, in four sections. The one source: the CLI flags (`add_engine_args`),
    `LLM(**kwargs)` (`engine_config(**kwargs)`) and the data-plane child's config that `serve`
    hands over (`to_json`) are all derived from these fields (common/src/pagedserve/common/settings.py)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (named like vLLM's), one per EngineConfig setting, grouped by section."""
    settings.add_arguments(parser, EngineConfig)


def engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig from flat settings (`block_size=4, model=...`): what `LLM(...)` takes."""
    return settings.from_kwargs(EngineConfig, kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return settings.from_arguments(EngineConfig, args)


DEFAULT_DATAPLANE_PORT = 50052


# See dataplane/src/pagedserve/dataplane/server/openmp.py: at libgomp's default (300,000) a busy loop of 1 s in another
# process held a decoding stream for 788 ms on 2 cores; at 3,000, for 55 ms (2.6x its gap).
OMP_SPIN_COUNT = 3000


# DataPlaneConfig's settings of the process's own endpoint: `serve` sets them for its child
# itself (a free loopback port, this start's link token; TLS and the insecure waiver have no
# use on loopback), and its flags of the same names are the control plane's public ones. Every
# other data-plane setting is a `serve` flag too, passed on to the child as it is.
ENDPOINT_SETTINGS = frozenset(
    {
        "host",
        "port",
        "tls_cert_file",
        "tls_key_file",
        "tls_client_ca_file",
        "dataplane_token_file",
        "allow_insecure_dataplane",
    }
)


@dataclass(frozen=True)
class DataPlaneConfig:
    """A data-plane process: its gRPC endpoint, TLS, metrics port and the engine it runs.

    `pagedserve dataplane` derives its flags from these fields; `pagedserve serve` hands its
    data-plane child this whole config as JSON (`--config-json`), never a rebuilt argv.

    Whoever reaches the port can run the model, so off loopback a control plane must prove
    itself: with a client certificate (`tls_client_ca_file`, mutual TLS) or the shared token
    (`dataplane_token_file`); `allow_insecure_dataplane` waives that on a trusted network.
    """

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a pod)")
    port: int = setting(DEFAULT_DATAPLANE_PORT, "gRPC port (0 picks a free one)")
    dataplane_id: str | None = setting(None, "name reported to control planes (default: HOSTNAME-PID)")
    metrics_port: int | None = setting(
        None, "serve Prometheus /metrics on this port (0: any) (default: none, no metrics port)"
    )
    tls_cert_file: str | None = setting(
        None, "serve gRPC over TLS with this certificate (PEM) (default: none, plaintext)"
    )
    tls_key_file: str | None = setting(None, "the certificate's private key (PEM) (default: none, plaintext)")
    tls_client_ca_file: str | None = setting(
        None, "require control planes to present a cert from this CA (mTLS) (default: none, no mTLS)"
    )
    dataplane_token_file: str | None = setting(
        None,
        "require control planes to send the shared token in this file (their --dataplane-token-file) "
        "(default: none, no token)",
    )
    allow_insecure_dataplane: bool = setting(
        False,
        "serve control planes without mTLS or a token on a non-loopback address (trusted networks only)",
    )
    omp_spin_count: int = setting(
        OMP_SPIN_COUNT,
        "spins an idle OpenMP (libgomp) thread of the engine makes before it sleeps "
        "(GOMP_SPINCOUNT, which wins when set in the environment): few, so a step does not "
        "stall while another process runs on the engine's cores; libgomp's own 300000 suits "
        "cores given to the engine alone",
        minimum=0,
        maximum=10**12,
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        check_bounds(self)
        if not isinstance(self.allow_insecure_dataplane, bool):
            raise ValueError(
                f"allow_insecure_dataplane must be a bool, got {self.allow_insecure_dataplane!r}"
            )
        authenticated = self.tls_client_ca_file is not None or self.dataplane_token_file is not None
        if not authenticated and not self.allow_insecure_dataplane and not is_loopback(self.host):
            raise ValueError(
                f"the data plane would let anyone who reaches {self.host}:{self.port} run the model: "
                "require control planes to authenticate with --tls-client-ca-file (mutual TLS) or "
                "--dataplane-token-file (a shared token), or pass --allow-insecure-dataplane on a trusted network"
            )
