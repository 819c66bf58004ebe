"""`pagedserve bench plan`: the KV memory budget for any model and GPU. Imports no torch.

For a Hugging Face config (a local folder's `config.json`, or the built-in table below, taken
from the models' published configs) and a GPU size, the usual budget (vLLM's, whose
`gpu_memory_utilization` caps what the whole process takes of the device):

    weights           = parameters (counted from the config) x bytes per weight element
    activations       = budget.peak_activation_bytes(max_num_batched_tokens, ...), an estimate
    KV memory         = GPU memory x gpu_memory_utilization - weights - activations
    KV bytes / token  = 2 (K and V) x layers x kv_heads x head_dim x bytes per KV element
    blocks            = KV memory / (block_size x KV bytes / token)
    max concurrency   = blocks / ceil(average tokens per request / block_size)   (paged)
                      = KV memory / (max_model_len x KV bytes / token)           (--contiguous)

With `--tensor-parallel-size N` (by default the fewest GPUs that fit the weights) each GPU
holds 1/N of the weights and of the KV heads, so the formula runs per GPU. The paged figure
counts whole blocks per request (not the naive `blocks x block_size / average`: it is
rounded down to requests that really fit, at most one partial block each). See
docs/capacity-planning.md for figures often quoted about PagedAttention checked against this.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.report import Report
from pagedserve.dataplane.kvcache import cdiv
from pagedserve.dataplane.kvcache.budget import (
    KV_DTYPE_BYTES,
    KVCacheShape,
    kv_memory_on_gpu,
    peak_activation_bytes,
    plan_kv_cache,
)

GiB = 2**30
# Bytes per weight of the quantized formats as the engine holds them in memory (packed panels:
# the values, plus a scale, and a min for the asymmetric ones, per group of inputs: float16
# where the file stores them so, else float32; docs/quantization.md). Their activations are
# float32.
QUANTIZED_WEIGHT_BYTES: dict[str, float] = {
    "q8_0": 1 + 2 / 32,
    "q6_k": 1 + 4 / 16,
    "q4_0": 0.5 + 4 / 32,
    "q4_1": 0.5 + 4 / 32,
    "q4_k": 0.5 + 8 / 32,
    "int8": 1.0,  # plus one scale per output row
}


def bytes_per_weight(weight_dtype: str) -> float:
    """In-memory bytes per weight of a float dtype or a quantized format."""
    return QUANTIZED_WEIGHT_BYTES.get(weight_dtype) or KV_DTYPE_BYTES[weight_dtype]


def activation_bytes_per_element(weight_dtype: str) -> int:
    """Activations run in the weights' float dtype, or float32 for a quantized format."""
    return 4 if weight_dtype in QUANTIZED_WEIGHT_BYTES else KV_DTYPE_BYTES[weight_dtype]


@dataclass(frozen=True)
class ModelShape:
    """What the formula needs from a decoder-only transformer's config."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False

    @property
    def num_parameters(self) -> int:
        """Llama-style decoder: embeddings, attention, gated MLP, two norms per layer, final norm, LM head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        return embed + self.num_layers * layer + h + (0 if self.tie_word_embeddings else embed)

    def kv_shape(self, kv_dtype: str, tensor_parallel_size: int = 1) -> KVCacheShape:
        """One GPU's KV per token: with tensor parallelism each GPU holds its share of the KV heads
        (a head is replicated when there are fewer heads than GPUs, as vLLM does)."""
        heads = cdiv(self.num_kv_heads, tensor_parallel_size)
        return KVCacheShape(self.num_layers, heads, self.head_dim, KV_DTYPE_BYTES[kv_dtype])

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any]) -> ModelShape:
        cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the decoder here
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            name=name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        )


# From each model's published config.json (Hugging Face), fields as named there.
BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("LLaMA-7B", 32, 4096, 32, 32, 128, 11008, 32000, 2048),
        ModelShape("LLaMA-13B", 40, 5120, 40, 40, 128, 13824, 32000, 2048),
        ModelShape("LLaMA-70B", 80, 8192, 64, 8, 128, 28672, 32000, 4096),  # Llama-2-70B
        ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, 32768, qkv_bias=True),
        ModelShape("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, 32768, qkv_bias=True),
        ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 8192, tie_word_embeddings=True),
    )
}

# Device memory as nvidia-smi reports it (MiB / 1024 = GiB): what torch.cuda.mem_get_info calls total.
GPUS: dict[str, float] = {
    "A100-40GB": 40.0,  # 40,960 MiB
    "A100-80GB": 80.0,  # 81,920 MiB
    "H100-80GB": 79.6,  # 81,559 MiB (SXM)
    "H200": 140.4,  # 143,771 MiB
    "L4": 22.5,  # 23,034 MiB
    "RTX-4090": 24.0,  # 24,564 MiB
}


def resolve_model(spec: str) -> ModelShape:
    """A built-in name (case-insensitive) or a local folder / config.json path."""
    for name, shape in BUILTIN_MODELS.items():
        if spec.lower() == name.lower():
            return shape
    path = Path(spec)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise FileNotFoundError(
            f"{spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a folder with config.json"
        )
    return ModelShape.from_hf_config(
        path.name if path.is_dir() else path.parent.name, json.loads(config.read_text())
    )


def parse_gpu(spec: str) -> float:
    """GiB of device memory: a preset name (A100-80GB, ...) or a number."""
    for name, gib in GPUS.items():
        if spec.lower() == name.lower():
            return gib
    try:
        value = float(spec.lower().removesuffix("gib").removesuffix("gb"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a GPU: {spec!r} (use {', '.join(GPUS)} or GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"GPU memory must be positive, got {spec!r}")
    return value


@dataclass(frozen=True)
class PlanRow:
    """Memory figures are per GPU; `num_blocks` is the block count every GPU holds (each block
    of a request lives on every GPU of the tensor-parallel group, its own share of the heads)."""

    model: str
    gpu_gib: float
    tensor_parallel_size: int
    weight_dtype: str
    kv_dtype: str
    parameters: int
    weight_bytes: int
    activation_bytes: int
    kv_memory_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    avg_tokens: int
    max_concurrency: int  # paged, requests of avg_tokens each
    max_model_len: int
    contiguous_concurrency: int  # requests of max_model_len slots each


def plan(
    model: ModelShape,
    gpu_gib: float,
    kv_dtype: str,
    *,
    weight_dtype: str = "float16",
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.90,
    block_size: int = 16,
    avg_tokens: int = 2048,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
) -> PlanRow:
    """One line of the plan; raises ValueError when the weights leave no room for KV.

    With tensor parallelism each GPU holds 1/tp of the weights and of the KV heads; the
    activation estimate is kept whole on every GPU (conservative)."""
    tp = tensor_parallel_size
    weight_bytes = cdiv(math.ceil(model.num_parameters * bytes_per_weight(weight_dtype)), tp)
    activations = peak_activation_bytes(
        max_num_batched_tokens,
        model.hidden_size,
        model.intermediate_size,
        activation_bytes_per_element(weight_dtype),
        max_num_seqs,
        model.vocab_size,
    )
    kv_memory = kv_memory_on_gpu(int(gpu_gib * GiB), gpu_memory_utilization, weight_bytes, activations)
    shape = model.kv_shape(kv_dtype, tp)
    budget = plan_kv_cache(shape, block_size, kv_memory)
    mml = max_model_len or model.max_position_embeddings
    return PlanRow(
        model=model.name,
        gpu_gib=gpu_gib,
        tensor_parallel_size=tp,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        parameters=model.num_parameters,  # the whole model; weight_bytes is one GPU's share
        weight_bytes=weight_bytes,
        activation_bytes=activations,
        kv_memory_bytes=kv_memory,
        kv_bytes_per_token=shape.bytes_per_token,
        block_size=block_size,
        num_blocks=budget.num_blocks,
        avg_tokens=avg_tokens,
        max_concurrency=budget.num_blocks // cdiv(avg_tokens, block_size),
        max_model_len=mml,
        contiguous_concurrency=kv_memory // (mml * shape.bytes_per_token),
    )


# -- the subcommand --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        nargs="+",
        default=[m for m in BUILTIN_MODELS if m != "SmolLM2-135M"],
        help=f"built-in ({', '.join(BUILTIN_MODELS)}) or a local Hugging Face folder (default: the big seven)",
    )
    p.add_argument("--gpu", type=parse_gpu, default=80.0, help=f"GiB or one of {', '.join(GPUS)}")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="GPUs per model (default: the fewest of 1, 2, 4, 8 that leave room for a KV cache)",
    )
    p.add_argument(
        "--dtype",
        default="float16",
        choices=["float32", "float16", "bfloat16", *QUANTIZED_WEIGHT_BYTES],
        help="weights: a float dtype, or a quantized format as the engine holds it (GGUF types, int8)",
    )
    p.add_argument(
        "--kv-dtypes",
        nargs="+",
        default=["float16", "fp8_e4m3"],
        choices=sorted(KV_DTYPE_BYTES),
        help="KV cache",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--avg-tokens", type=int, default=2048, help="average tokens (prompt + output) per request"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="for --contiguous (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="sizes the activation estimate")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sizes the activation estimate (logits)")
    p.add_argument(
        "--contiguous", action="store_true", help="also: requests admitted with max_model_len pre-allocated"
    )


def smallest_tensor_parallel_size(model: ModelShape, gpu_gib: float, **kwargs: Any) -> int:
    """The fewest GPUs (1, 2, 4 or 8) whose memory leaves room for a KV cache; 8 if none does."""
    for tp in (1, 2, 4, 8):
        try:
            plan(model, gpu_gib, "float16", tensor_parallel_size=tp, **kwargs)
        except ValueError:
            continue
        return tp
    return 8


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    rows: list[PlanRow] = []
    skipped: list[str] = []
    for spec in args.model:
        model = resolve_model(spec)
        tp = args.tensor_parallel_size or smallest_tensor_parallel_size(
            model,
            args.gpu,
            weight_dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        for kv_dtype in args.kv_dtypes:
            try:
                rows.append(
                    plan(
                        model,
                        args.gpu,
                        kv_dtype,
                        tensor_parallel_size=tp,
                        weight_dtype=args.dtype,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        block_size=args.block_size,
                        avg_tokens=args.avg_tokens,
                        max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs,
                    )
                )
            except ValueError as exc:
                skipped.append(f"{model.name}: {exc}")
                break
    header = [
        "model",
        "GPUs",
        "params",
        "weights / GPU",
        "KV dtype",
        "KV / token (all GPUs)",
        "KV memory / GPU",
        "blocks",
        f"max conc. @ {args.avg_tokens} tok",
    ]
    if args.contiguous:
        header.append("contiguous @ max_model_len")
    table = []
    for r in rows:
        line = [
            r.model,
            str(r.tensor_parallel_size),
            f"{r.parameters / 1e9:.2f} B",
            f"{r.weight_bytes / GiB:.1f} GiB",
            r.kv_dtype,
            f"{r.kv_bytes_per_token * r.tensor_parallel_size / 2**10:,.0f} KiB",
            f"{r.kv_memory_bytes / GiB:.1f} GiB",
            f"{r.num_blocks:,}",
            f"{r.max_concurrency:,}",
        ]
        if args.contiguous:
            line.append(f"{r.contiguous_concurrency:,} @ {r.max_model_len}")
        table.append(line)
    notes = [
        f"GPU {args.gpu:g} GiB x gpu_memory_utilization {args.gpu_memory_utilization} - weights ({args.dtype}) - "
        f"activations (estimate at {args.max_num_batched_tokens} batched tokens, {args.max_num_seqs} seqs); "
        f"block_size {args.block_size}",
        *skipped,
    ]
    report.table("KV cache plan", header, table, notes)
    _plot(report, rows, args.contiguous)
    return {"rows": [asdict(r) for r in rows], "skipped": skipped}


def _plot(report: Report, rows: list[PlanRow], contiguous: bool) -> None:
    fig = report.figure(width=9, height=4.5)
    if fig is None or not rows:
        return
    ax = fig.axes[0]
    models = list(dict.fromkeys(r.model for r in rows))
    series: list[tuple[str, dict[str, int]]] = []
    for kv in dict.fromkeys(r.kv_dtype for r in rows):
        series.append((f"paged, KV {kv}", {r.model: r.max_concurrency for r in rows if r.kv_dtype == kv}))
        if contiguous:
            series.append(
                (
                    f"contiguous, KV {kv}",
                    {r.model: r.contiguous_concurrency for r in rows if r.kv_dtype == kv},
                )
            )
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        ax.bar(
            [i + k * width for i in range(len(models))],
            [values.get(m, 0) for m in models],
            width,
            label=label,
        )
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(models))])
    ax.set_xticklabels(models, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(f"max concurrent requests of {rows[0].avg_tokens} tokens (log)")
    gpus = ", ".join(
        dict.fromkeys(f"{r.model}: {r.tensor_parallel_size}" for r in rows if r.tensor_parallel_size > 1)
    )
    ax.set_title(f"{rows[0].gpu_gib:g} GiB GPUs" + (f" (GPUs per model: {gpus})" if gpus else ""), fontsize=8)
    ax.legend(fontsize=7)
    report.save_figure(fig)
