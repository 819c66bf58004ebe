"""The matmul roofline of an offline run: the model's linear layers as plain `torch.matmul`.

`LinearShapes` gives a llama-style decoder's matmul shapes (FLOPs per token, LM head per
sampled row); `measure_roofline` times those matmuls on fresh fp32 weights at the row counts
the engine's steps actually had, so "achieved GFLOP/s / roofline GFLOP/s" says how much of
the step time is the unavoidable matmuls. torch is imported only when something is timed.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Step(Protocol):
    """What the roofline reads of an engine step (benchmarks.throughput.StepRecord is one).
    A protocol rather than an import: throughput imports this module."""

    @property
    def kind(self) -> str: ...  # "decode" | "prefill" | "mixed" | "unknown"

    @property
    def num_batched_tokens(self) -> int: ...

    @property
    def num_sampled(self) -> int: ...


# -- model FLOPs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShapes:
    """The matmul shapes of one forward pass, as (name, in_features, out_features)."""

    layer: tuple[tuple[str, int, int], ...]  # one decoder layer
    num_layers: int
    lm_head: tuple[int, int]  # (hidden, vocab): applied to sampled rows only

    @property
    def flops_per_token(self) -> int:
        """Linear-layer FLOPs for one token through every decoder layer (2 per multiply-add)."""
        return 2 * self.num_layers * sum(i * o for _, i, o in self.layer)

    @property
    def lm_head_flops_per_row(self) -> int:
        return 2 * self.lm_head[0] * self.lm_head[1]

    def step_flops(self, num_tokens: int, num_sampled: int) -> int:
        return self.flops_per_token * num_tokens + self.lm_head_flops_per_row * num_sampled

    def describe(self) -> str:
        shapes = ", ".join(f"{n} {i}x{o}" for n, i, o in self.layer)
        return (
            f"{self.num_layers} layers x ({shapes}) = {self.flops_per_token / 1e6:.1f} MFLOP/token; "
            f"LM head {self.lm_head[0]}x{self.lm_head[1]} = {self.lm_head_flops_per_row / 1e6:.1f} "
            f"MFLOP per sampled row"
        )


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
    return LinearShapes(layer, int(cfg.num_hidden_layers), (hidden, int(cfg.vocab_size)))


# -- roofline ----------------------------------------------------------------------------------
class MatmulStack:
    """Fresh fp32 weights of the model's linear shapes, one set per layer, run as x @ W.T."""

    def __init__(self, shapes: LinearShapes, seed: int = 0) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.layers = [
            [torch.randn(o, i, generator=gen) * 0.02 for _, i, o in shapes.layer]
            for _ in range(shapes.num_layers)
        ]
        hidden, vocab = shapes.lm_head
        self.lm_head = torch.randn(vocab, hidden, generator=gen) * 0.02
        self._gen = gen

    def time_stack(self, rows: int, lm_rows: int, reps: int) -> float:
        """Median seconds of one pass: every layer's linears on `rows` rows, LM head on `lm_rows`."""
        import torch

        inputs = {i: torch.randn(rows, i, generator=self._gen) for _, i, _ in self.shapes.layer}
        head_in = torch.randn(max(lm_rows, 1), self.shapes.lm_head[0], generator=self._gen)
        dims = [i for _, i, _ in self.shapes.layer]

        def one_pass() -> None:
            for weights in self.layers:
                for d, w in zip(dims, weights, strict=True):
                    torch.matmul(inputs[d], w.T)
            if lm_rows:
                torch.matmul(head_in, self.lm_head.T)

        times = []
        with torch.inference_mode():
            one_pass()  # warm-up
            for _ in range(reps):
                t = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


@dataclass
class RooflinePoint:
    rows: int
    lm_rows: int
    seconds: float
    gflops: float


@dataclass
class Roofline:
    decode_rows: int  # mean sequences per decode step (rounded)
    decode: RooflinePoint | None
    decode_curve: list[RooflinePoint] = field(default_factory=list)
    decode_stepwise_seconds: float | None = None  # sum over decode steps of the matmul time at its rows
    prefill: RooflinePoint | None = None
    setup_seconds: float = 0.0


def _interp(curve: Sequence[RooflinePoint], rows: int) -> float:
    """Matmul stack seconds at `rows`, linear between measured points (time is ~affine in rows)."""
    pts = sorted(curve, key=lambda p: p.rows)
    if rows <= pts[0].rows:
        return pts[0].seconds * rows / pts[0].rows if rows < pts[0].rows else pts[0].seconds
    for a, b in itertools.pairwise(pts):
        if a.rows <= rows <= b.rows:
            f = (rows - a.rows) / (b.rows - a.rows)
            return a.seconds + f * (b.seconds - a.seconds)
    last = pts[-1]
    return last.seconds * rows / last.rows


def measure_roofline(shapes: LinearShapes, steps: Sequence[Step], reps: int, skip_prefill: bool) -> Roofline:
    t = time.perf_counter()
    stack = MatmulStack(shapes)
    setup = time.perf_counter() - t
    decode = [s for s in steps if s.kind == "decode"]
    prefill = [s for s in steps if s.kind != "decode"]

    def point(rows: int, lm_rows: int) -> RooflinePoint:
        sec = stack.time_stack(rows, lm_rows, reps)
        return RooflinePoint(rows, lm_rows, sec, shapes.step_flops(rows, lm_rows) / sec / 1e9)

    roof = Roofline(decode_rows=0, decode=None, setup_seconds=setup)
    if decode:
        mean_rows = max(1, round(sum(s.num_batched_tokens for s in decode) / len(decode)))
        roof.decode_rows = mean_rows
        roof.decode = point(mean_rows, mean_rows)
        max_rows = max(s.num_batched_tokens for s in decode)
        grid = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) if r < max_rows} | {max_rows})
        roof.decode_curve = [roof.decode if r == mean_rows else point(r, r) for r in grid]
        if mean_rows not in grid:
            roof.decode_curve.append(roof.decode)
        roof.decode_stepwise_seconds = sum(_interp(roof.decode_curve, s.num_batched_tokens) for s in decode)
    if prefill and not skip_prefill:
        rows = max(1, round(sum(s.num_batched_tokens for s in prefill) / len(prefill)))
        lm_rows = round(sum(s.num_sampled for s in prefill) / len(prefill))
        roof.prefill = point(rows, lm_rows)
    return roof  # the weights go with `stack`
