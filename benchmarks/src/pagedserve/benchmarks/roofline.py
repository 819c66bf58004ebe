"""The roofline of an offline run: the machine's own limits, measured in the same run.

`LinearShapes` gives a llama-style decoder's matmul shapes (FLOPs per token, LM head per
sampled row, weight bytes) and its attention shape (KV bytes per context token, FLOPs per
query-key pair); `measure_machine` measures this machine's two limits: the peak fp32 GFLOP/s
of a large square sgemm (the faster of plain `torch.matmul` and a oneDNN prepacked linear,
the library our engine uses) and the memory read bandwidth (a streaming sum over a buffer far
larger than the caches).

A step's roofline time is the sum of two phases, which cannot overlap within a layer (the
attention needs the q/k/v projections, the o projection needs the attention):

- linears: max(linear FLOPs / peak, weight bytes / bandwidth): at small row counts every
  weight must still be read once per step;
- attention: max(attention FLOPs / peak, KV bytes / bandwidth): every K and V element of
  every scheduled sequence's context (its cached tokens and this step's) must be read from
  the paged cache at least once.

The linears-only figure (the definition before attention was counted) is kept alongside.
`roofline_by_class` sums both over the engine's decode and prefill steps, so "roofline time /
measured time" is the fraction of the machine's limit each step class reached. torch is
imported only when something is timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

FP32_BYTES = 4
# The sgemm that measures the compute peak: large enough that packing and threading costs
# vanish (2 x 2048^3 = 17 GFLOP, ~0.1 s at 200 GFLOP/s).
PEAK_SGEMM_SIZE = 2048
# The bandwidth buffer: 8x the 32 MiB L3 of the reference machine, so the sum streams from DRAM.
BANDWIDTH_BUFFER_BYTES = 256 * 2**20
# Row counts of the decode roofline curve (plus the largest decode step seen).
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Step(Protocol):
    """What the roofline reads of an engine step (pagedserve.benchmarks.throughput_engine.StepRecord is one).
    A protocol rather than an import: throughput_engine imports this module."""

    @property
    def kind(self) -> str: ...  # "decode" | "prefill" | "mixed" | "unknown"

    @property
    def num_batched_tokens(self) -> int: ...

    @property
    def num_sampled(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def context_tokens(self) -> int: ...  # tokens whose K and V attention reads (0: unknown)

    @property
    def attention_pairs(self) -> int: ...  # (query, key) pairs attention scores (0: unknown)


# -- model FLOPs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShapes:
    """The matmul shapes of one forward pass, as (name, in_features, out_features), and the
    attention shape (0 heads: attention not counted)."""

    layer: tuple[tuple[str, int, int], ...]  # one decoder layer
    num_layers: int
    lm_head: tuple[int, int]  # (hidden, vocab): applied to sampled rows only
    num_heads: int = 0  # query heads
    num_kv_heads: int = 0  # K/V heads held in the cache (grouped-query attention shares them)
    head_dim: int = 0

    @property
    def flops_per_token(self) -> int:
        """Linear-layer FLOPs for one token through every decoder layer (2 per multiply-add)."""
        return 2 * self.num_layers * sum(i * o for _, i, o in self.layer)

    @property
    def lm_head_flops_per_row(self) -> int:
        return 2 * self.lm_head[0] * self.lm_head[1]

    def step_flops(self, num_tokens: int, num_sampled: int) -> int:
        return self.flops_per_token * num_tokens + self.lm_head_flops_per_row * num_sampled

    def step_weight_bytes(self, num_sampled: int, element_bytes: int = FP32_BYTES) -> int:
        """Weight bytes a step must read at least once: every layer's linears, plus the LM
        head when any row is sampled."""
        layer = self.num_layers * sum(i * o for _, i, o in self.layer)
        head = self.lm_head[0] * self.lm_head[1] if num_sampled else 0
        return element_bytes * (layer + head)

    def kv_bytes_per_token(self, element_bytes: int = FP32_BYTES) -> int:
        """K and V of one context token, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def step_kv_bytes(self, context_tokens: int, element_bytes: int = FP32_BYTES) -> int:
        """KV-cache bytes a step's attention must read at least once: `context_tokens` is the
        sum over its sequences of their length after this step's tokens."""
        return self.kv_bytes_per_token(element_bytes) * context_tokens

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token against one key, every layer: QK^T and PV, each
        2 x head_dim per head (GQA shares K/V, not the work)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def step_attention_flops(self, attention_pairs: int) -> int:
        """Attention FLOPs of a step that scores `attention_pairs` (query, key) pairs; a decode
        step's pairs are its context tokens (one query per sequence)."""
        return self.attention_flops_per_pair * attention_pairs

    def describe(self) -> str:
        shapes = ", ".join(f"{n} {i}x{o}" for n, i, o in self.layer)
        text = (
            f"{self.num_layers} layers x ({shapes}) = {self.flops_per_token / 1e6:.1f} MFLOP/token; "
            f"LM head {self.lm_head[0]}x{self.lm_head[1]} = {self.lm_head_flops_per_row / 1e6:.1f} "
            f"MFLOP per sampled row"
        )
        if self.num_heads:
            text += (
                f"; attention {self.num_heads} heads ({self.num_kv_heads} KV) x {self.head_dim}: "
                f"{self.attention_flops_per_pair / 1e3:.1f} kFLOP per query-key pair, "
                f"{self.kv_bytes_per_token()} B of fp32 KV per context token"
            )
        return text


def linear_shapes(cfg: Any) -> LinearShapes:
    """Shapes of a llama-style decoder (llama, mistral, qwen2/3): attention + gated MLP."""
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    inter = int(cfg.intermediate_size)
    layer = (
        ("q", hidden, heads * head_dim),
        ("k", hidden, kv_heads * head_dim),
        ("v", hidden, kv_heads * head_dim),
        ("o", heads * head_dim, hidden),
        ("gate", hidden, inter),
        ("up", hidden, inter),
        ("down", inter, hidden),
    )
    return LinearShapes(
        layer,
        int(cfg.num_hidden_layers),
        (hidden, int(cfg.vocab_size)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )


# -- the machine's limits -----------------------------------------------------------------------
@dataclass(frozen=True)
class MachineLimits:
    """This machine's fp32 compute peak and memory read bandwidth, measured in this run."""

    peak_gflops: float
    peak_source: str  # which sgemm reached the peak: "onednn-packed" or "torch.matmul"
    matmul_gflops: float  # plain torch.matmul on the same shape (for reference)
    bandwidth_gbs: float
    setup_seconds: float = 0.0

    def phase_seconds(self, flops: int, nbytes: int) -> float:
        """The least time of one phase: its FLOPs at the peak or its reads at the bandwidth,
        whichever is longer."""
        return max(flops / (self.peak_gflops * 1e9), nbytes / (self.bandwidth_gbs * 1e9))

    def step_seconds(
        self, flops: int, weight_bytes: int, attention_flops: int = 0, kv_bytes: int = 0
    ) -> float:
        """The least time a step can take: its linears' phase plus its attention's phase.
        They add rather than overlap: within a layer the attention waits for q/k/v and the
        o projection waits for the attention. With no attention work it is the linears alone."""
        return self.phase_seconds(flops, weight_bytes) + self.phase_seconds(attention_flops, kv_bytes)

    def attainable_gflops(self, flops: int, weight_bytes: int) -> float:
        """min(compute peak, bandwidth line) for a step of these FLOPs and weight bytes."""
        return (
            min(self.peak_gflops, flops / weight_bytes * self.bandwidth_gbs)
            if weight_bytes
            else self.peak_gflops
        )


def _median_seconds(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_machine(
    reps: int = 3, size: int = PEAK_SGEMM_SIZE, buffer_bytes: int = BANDWIDTH_BUFFER_BYTES
) -> MachineLimits:
    """Time a size^3 fp32 sgemm (torch.matmul and, where available, oneDNN prepacked) and a
    streaming sum over `buffer_bytes`; medians of `reps` runs after a warm-up each."""
    import torch

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    flops = 2 * size**3
    with torch.inference_mode():
        matmul = flops / _median_seconds(lambda: torch.matmul(a, b), reps) / 1e9
        peak, source = matmul, "torch.matmul"
        if torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(b)
            onednn = (
                flops
                / _median_seconds(
                    lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), reps
                )
                / 1e9
            )
            if onednn > peak:
                peak, source = onednn, "onednn-packed"
        buf = torch.ones(buffer_bytes // FP32_BYTES)
        bandwidth = buf.numel() * FP32_BYTES / _median_seconds(buf.sum, reps) / 1e9
    return MachineLimits(peak, source, matmul, bandwidth, time.perf_counter() - t0)


# -- the roofline of the engine's steps ------------------------------------------------------------
@dataclass
class ClassRoofline:
    """One step class (decode or prefill) of the engine against the machine's limits."""

    kind: str
    steps: int
    seconds: float  # measured
    roofline_seconds: float  # sum over the steps of MachineLimits.step_seconds: linears + attention
    flops: int  # linear FLOPs
    mean_rows: float
    linear_roofline_seconds: float = 0.0  # the same sum with the linears alone (no attention)
    attention_flops: int = 0
    kv_bytes: int = 0  # KV-cache bytes the attention reads at least once
    mean_context_tokens: float = 0.0  # per step: tokens whose K and V attention reads

    @property
    def achieved_gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def roofline_gflops(self) -> float:
        return self.flops / self.roofline_seconds / 1e9 if self.roofline_seconds else 0.0

    @property
    def fraction(self) -> float:
        """Roofline time / measured time: 1.0 means the steps ran at the machine's limit."""
        return self.roofline_seconds / self.seconds if self.seconds else 0.0

    @property
    def linear_roofline_gflops(self) -> float:
        return self.flops / self.linear_roofline_seconds / 1e9 if self.linear_roofline_seconds else 0.0

    @property
    def linear_fraction(self) -> float:
        """Linears-only roofline time / measured time (attention counted as free)."""
        return self.linear_roofline_seconds / self.seconds if self.seconds else 0.0


@dataclass
class RooflinePoint:
    rows: int
    seconds: float
    gflops: float
    bound: str  # "compute" or "bandwidth"


@dataclass
class Roofline:
    machine: MachineLimits
    classes: dict[str, ClassRoofline] = field(default_factory=dict)
    decode_curve: list[RooflinePoint] = field(default_factory=list)  # decode steps of `rows` rows
    decode_bands: list[ClassRoofline] = field(default_factory=list)  # decode steps by row band


def _class_roofline(
    kind: str,
    shapes: LinearShapes,
    machine: MachineLimits,
    members: Sequence[Step],
    kv_element_bytes: int,
) -> ClassRoofline:
    linear = [
        (shapes.step_flops(s.num_batched_tokens, s.num_sampled), shapes.step_weight_bytes(s.num_sampled))
        for s in members
    ]
    attention = [
        (
            shapes.step_attention_flops(s.attention_pairs),
            shapes.step_kv_bytes(s.context_tokens, kv_element_bytes),
        )
        for s in members
    ]
    return ClassRoofline(
        kind=kind,
        steps=len(members),
        seconds=sum(s.seconds for s in members),
        roofline_seconds=sum(
            machine.step_seconds(*lin, *att) for lin, att in zip(linear, attention, strict=True)
        ),
        flops=sum(f for f, _ in linear),
        mean_rows=sum(s.num_batched_tokens for s in members) / len(members),
        linear_roofline_seconds=sum(machine.step_seconds(*lin) for lin in linear),
        attention_flops=sum(f for f, _ in attention),
        kv_bytes=sum(b for _, b in attention),
        mean_context_tokens=sum(s.context_tokens for s in members) / len(members),
    )


def roofline_by_class(
    shapes: LinearShapes, machine: MachineLimits, steps: Sequence[Step], kv_element_bytes: int = FP32_BYTES
) -> dict[str, ClassRoofline]:
    """Decode steps and prefill steps (mixed steps count as prefill) against the machine's
    limits; `kv_element_bytes` is the KV cache's element size (fp32: 4)."""
    out: dict[str, ClassRoofline] = {}
    for kind in ("decode", "prefill"):
        members = [s for s in steps if (s.kind == "decode") == (kind == "decode")]
        if members:
            out[kind] = _class_roofline(kind, shapes, machine, members, kv_element_bytes)
    return out


# Decode steps grouped by row count: below the ridge point (~14 rows here) a step is bound by
# streaming the weights, near it by both, above it by compute; the bands show which regime
# the class's fraction loses in.
DECODE_ROW_BANDS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, None))


def roofline_by_decode_rows(
    shapes: LinearShapes, machine: MachineLimits, steps: Sequence[Step], kv_element_bytes: int = FP32_BYTES
) -> list[ClassRoofline]:
    """The decode steps per row band of DECODE_ROW_BANDS (kind "decode 9-16 rows"; empty bands
    left out), each against the same roofline as the decode class."""
    out = []
    for lo, hi in DECODE_ROW_BANDS:
        members = [
            s
            for s in steps
            if s.kind == "decode"
            and s.num_batched_tokens >= lo
            and (hi is None or s.num_batched_tokens <= hi)
        ]
        if members:
            name = f"decode {lo}-{hi} rows" if hi is not None else f"decode {lo}+ rows"
            out.append(_class_roofline(name, shapes, machine, members, kv_element_bytes))
    return out


def decode_curve(shapes: LinearShapes, machine: MachineLimits, max_rows: int) -> list[RooflinePoint]:
    """Linears-only roofline time of a decode step (every row sampled) at row counts up to
    max_rows: its attention depends on the rows' context lengths, not on the row count."""
    points = []
    for rows in sorted({r for r in CURVE_ROWS if r < max_rows} | {max(1, max_rows)}):
        flops, nbytes = shapes.step_flops(rows, rows), shapes.step_weight_bytes(rows)
        sec = machine.step_seconds(flops, nbytes)
        bound = (
            "compute"
            if flops / (machine.peak_gflops * 1e9) >= nbytes / (machine.bandwidth_gbs * 1e9)
            else "bandwidth"
        )
        points.append(RooflinePoint(rows, sec, flops / sec / 1e9, bound))
    return points


def measure_roofline(
    shapes: LinearShapes,
    steps: Sequence[Step],
    reps: int,
    skip_prefill: bool = False,
    kv_element_bytes: int = FP32_BYTES,
) -> Roofline:
    """Measure the machine, then place the engine's steps against it (prefill left out with skip_prefill)."""
    machine = measure_machine(reps)
    classes = roofline_by_class(shapes, machine, steps, kv_element_bytes)
    if skip_prefill:
        classes.pop("prefill", None)
    decode_rows = [s.num_batched_tokens for s in steps if s.kind == "decode"]
    curve = decode_curve(shapes, machine, max(decode_rows)) if decode_rows else []
    bands = roofline_by_decode_rows(shapes, machine, steps, kv_element_bytes)
    return Roofline(machine, classes, curve, bands)
