"""The matmul bound of a `bench throughput` run: how fast the workload could go if the step
were its matmuls alone, at the rate the engine's own linears reach on this machine.

Why beside the roofline (roofline.py): that one sets each step against a large fp32 sgemm
and the memory bandwidth, whatever the engine's weights are held in. This one asks a narrower
question the speed work needs: with bf16 panels or int8 weights, how far is the run from its
own kernels' best? So the peak is measured on the loaded engine itself, after the timed run:
one decoder layer's linear modules and the LM head, called as the step calls them (fp32
activations in, whatever kernel and weight dtype serve them), at PROBE_ROWS rows, best of
PROBE_REPS rounds (noise only ever slows a round). One layer's modules stand for all of them:
every layer has the same shapes. The bound's time is the layers' FLOPs at the layers' best
rate plus the head's FLOPs at the head's.

FLOPs of the workload: 2 per multiply-add of every decoder linear for every token the engine
computed (prompt tokens a prefix-cache hit skipped are not computed), plus the LM head for
every sampled row. Biases and elementwise work are left out; attention's FLOPs are given
beside (QK^T and PV, from each step's query-key pairs), not added, since the attention
kernel is not a matmul at these rates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.benchmarks.roofline import LinearShapes, Step

# Decode batches of the workloads run up to 64 rows; prefill chunks are larger, where the
# kernels reach their best.
PROBE_ROWS = (64, 256)
PROBE_REPS = 5


def matmul_params(shapes: LinearShapes) -> int:
    """Weights every computed token multiplies through: every decoder linear, and the LM head."""
    layer = sum(i * o for _, i, o in shapes.layer)
    return shapes.num_layers * layer + shapes.lm_head[0] * shapes.lm_head[1]


def workload_flops(shapes: LinearShapes, computed_tokens: int, sampled_rows: int) -> int:
    """Matmul FLOPs of `computed_tokens` through the decoder and `sampled_rows` through the LM head."""
    return shapes.flops_per_token * computed_tokens + shapes.lm_head_flops_per_row * sampled_rows


@dataclass(frozen=True)
class MatmulPeak:
    """The best rates of the decoder layer's linears and of the LM head over the probed row
    counts. Two rates, not one: the head is a large share of one layer's probe but a small one
    of the workload (every layer runs for every computed token, the head for sampled rows only)."""

    layer_gflops: float
    head_gflops: float  # the layer rate where the model has no head to probe
    by_rows: dict[int, tuple[float, float]]  # rows -> (layer, head) GFLOP/s
    kernels: str  # the probed modules, as their extra_repr says what serves them
    seconds: float = 0.0  # the probe's wall time


@dataclass(frozen=True)
class MatmulBound:
    layer_flops: int
    head_flops: int
    attention_flops: int
    layer_gflops: float
    head_gflops: float
    output_tokens: int
    seconds: float  # the run's measured time, end to end

    @property
    def flops(self) -> int:
        return self.layer_flops + self.head_flops

    @property
    def bound_seconds(self) -> float:
        return self.layer_flops / (self.layer_gflops * 1e9) + self.head_flops / (self.head_gflops * 1e9)

    @property
    def peak_gflops(self) -> float:
        """The rate the workload's mix of layer and head FLOPs runs at, at the probed peaks."""
        return self.flops / self.bound_seconds / 1e9

    @property
    def bound_tok_s(self) -> float:
        return self.output_tokens / self.bound_seconds

    @property
    def reached(self) -> float:
        """Bound time / measured time: 1.0 is a run that spent its time in matmuls at the peak."""
        return self.bound_seconds / self.seconds

    def line(self) -> str:
        return (
            f"matmul bound {self.bound_tok_s:,.1f} tok/s ({self.flops / 1e9:,.1f} GFLOP of linears at "
            f"{self.peak_gflops:,.1f} GFLOP/s: layers {self.layer_gflops:,.1f}, LM head "
            f"{self.head_gflops:,.1f}); this run reached {100 * self.reached:.1f} % of it "
            f"(attention {self.attention_flops / 1e9:,.1f} GFLOP more, not counted)"
        )


def matmul_bound(
    shapes: LinearShapes, steps: Sequence[Step], peak: MatmulPeak, output_tokens: int, seconds: float
) -> MatmulBound:
    """The run's steps (their computed and sampled rows) against `peak`."""
    computed = sum(s.num_batched_tokens for s in steps)
    sampled = sum(s.num_sampled for s in steps)
    attention = sum(shapes.step_attention_flops(s.attention_pairs) for s in steps)
    return MatmulBound(
        workload_flops(shapes, computed, 0),
        workload_flops(shapes, 0, sampled),
        attention,
        peak.layer_gflops,
        peak.head_gflops,
        output_tokens,
        seconds,
    )


def probe_modules(model: Any) -> tuple[list[Any], Any]:
    """The linear modules of the model's first decoder layer (those without linear children:
    a fused q/k/v counts once), and its LM head (None where it is not a linear module)."""

    def is_linear(m: Any) -> bool:
        return isinstance(getattr(m, "in_features", None), int) and isinstance(
            getattr(m, "out_features", None), int
        )

    layer = next((m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")), None)
    if layer is None:
        raise ValueError(f"{type(model).__name__} has no decoder layer to probe")
    found = [
        m
        for m in layer.modules()
        if is_linear(m) and not any(is_linear(c) for c in m.modules() if c is not m)
    ]
    head = model.output_embeddings() if hasattr(model, "output_embeddings") else None
    return found, head if head is not None and is_linear(head) else None


def _best_gflops(modules: Sequence[Any], rows: int, reps: int, gen: Any, device: Any) -> float:
    """GFLOP/s of `modules` called one after another on `rows` rows, best of `reps` rounds."""
    import torch

    inputs = [torch.randn(rows, m.in_features, generator=gen).to(device) for m in modules]
    flops = sum(2 * rows * m.in_features * m.out_features for m in modules)
    for m, x in zip(modules, inputs, strict=True):  # warm-up
        m(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for m, x in zip(modules, inputs, strict=True):
            m(x)
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def probe_peak(model: Any, rows: Sequence[int] = PROBE_ROWS, reps: int = PROBE_REPS) -> MatmulPeak:
    """Time `probe_modules(model)` at each row count: the layer's linears together, the head
    alone; each one's best rate."""
    import torch

    t0 = time.perf_counter()
    layer, head = probe_modules(model)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    by_rows: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for n in rows:
            layer_rate = _best_gflops(layer, n, reps, gen, device)
            head_rate = _best_gflops([head], n, reps, gen, device) if head is not None else layer_rate
            by_rows[n] = (layer_rate, head_rate)
    kinds = sorted({_kind(m) for m in [*layer, *([head] if head is not None else [])]})
    return MatmulPeak(
        max(r[0] for r in by_rows.values()),
        max(r[1] for r in by_rows.values()),
        by_rows,
        "; ".join(kinds),
        time.perf_counter() - t0,
    )


def _kind(module: Any) -> str:
    """The module's class and what its extra_repr says serves it, less its shape."""
    parts = [p.strip() for p in module.extra_repr().split(",")]
    rest = [p for p in parts if p and not p.startswith(("in_features", "out_features"))]
    return f"{type(module).__name__}({', '.join(rest)})" if rest else type(module).__name__
