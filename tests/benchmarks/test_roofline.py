"""The roofline: the machine's limits (compute peak, read bandwidth) and the engine's step
classes placed against min(compute, bandwidth line) at their own row counts."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from benchmarks.roofline import (
    MachineLimits,
    decode_curve,
    linear_shapes,
    measure_machine,
    roofline_by_class,
)

# A llama-style shape small enough to reason about: hidden 4, 2 heads of 2, 1 kv head, MLP 8.
CFG = SimpleNamespace(
    hidden_size=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=8,
    num_hidden_layers=3,
    vocab_size=10,
)
# 100 GFLOP/s peak, 10 GB/s: a step is bandwidth-bound below 10 FLOP per weight byte.
MACHINE = MachineLimits(peak_gflops=100.0, peak_source="test", matmul_gflops=50.0, bandwidth_gbs=10.0)


@dataclass
class FakeStep:
    kind: str
    num_batched_tokens: int
    num_sampled: int
    seconds: float


def test_weight_bytes_count_the_lm_head_only_when_a_row_is_sampled() -> None:
    shapes = linear_shapes(CFG)
    # per layer: q 4x4, k 4x2, v 4x2, o 4x4, gate 4x8, up 4x8, down 8x4 = 144 weights
    assert shapes.step_weight_bytes(0) == 4 * 3 * 144
    assert shapes.step_weight_bytes(5) == 4 * (3 * 144 + 4 * 10)


def test_step_time_is_the_longer_of_compute_and_weight_reads() -> None:
    # 1 GFLOP and 1 MB: compute-bound (10 ms vs 0.1 ms)
    assert MACHINE.step_seconds(10**9, 10**6) == pytest.approx(0.01)
    assert MACHINE.attainable_gflops(10**9, 10**6) == pytest.approx(100.0)
    # 1 MFLOP and 1 MB: bandwidth-bound, 1 FLOP/byte x 10 GB/s = 10 GFLOP/s
    assert MACHINE.step_seconds(10**6, 10**6) == pytest.approx(1e-4)
    assert MACHINE.attainable_gflops(10**6, 10**6) == pytest.approx(10.0)


def test_step_classes_sum_each_steps_own_roofline_time() -> None:
    shapes = linear_shapes(CFG)
    steps = [
        FakeStep("decode", 2, 2, 1.0),
        FakeStep("decode", 6, 6, 3.0),
        FakeStep("prefill", 50, 0, 2.0),
        FakeStep("mixed", 20, 1, 2.0),
    ]
    classes = roofline_by_class(shapes, MACHINE, steps)
    assert sorted(classes) == ["decode", "prefill"]
    dec, pre = classes["decode"], classes["prefill"]
    assert (dec.steps, dec.seconds, dec.mean_rows) == (2, 4.0, 4.0)
    assert (pre.steps, pre.seconds, pre.mean_rows) == (2, 4.0, 35.0)

    def own(s: FakeStep) -> float:
        return MACHINE.step_seconds(
            shapes.step_flops(s.num_batched_tokens, s.num_sampled), shapes.step_weight_bytes(s.num_sampled)
        )

    assert dec.roofline_seconds == pytest.approx(own(steps[0]) + own(steps[1]))
    assert dec.fraction == pytest.approx(dec.roofline_seconds / 4.0)
    assert dec.flops == shapes.step_flops(2, 2) + shapes.step_flops(6, 6)
    assert dec.achieved_gflops == pytest.approx(dec.flops / 4.0 / 1e9)
    assert pre.roofline_seconds == pytest.approx(own(steps[2]) + own(steps[3]))


def test_decode_curve_turns_from_bandwidth_to_compute_bound() -> None:
    shapes = linear_shapes(CFG)
    # per decode row: 2 * (432 + 40) FLOP over 4 * 472 bytes = 0.5 FLOP/byte; the line meets
    # the 100 GFLOP/s peak at 20 rows
    curve = decode_curve(shapes, MACHINE, 40)
    assert [p.rows for p in curve] == [1, 2, 4, 8, 16, 32, 40]
    assert [p.bound for p in curve] == ["bandwidth"] * 5 + ["compute"] * 2
    assert curve[0].gflops == pytest.approx(5.0)
    assert curve[-1].gflops == pytest.approx(100.0)


def test_measure_machine_reports_positive_limits() -> None:
    m = measure_machine(reps=1, size=64, buffer_bytes=2**20)
    assert m.peak_gflops >= m.matmul_gflops > 0
    assert m.peak_source in ("torch.matmul", "onednn-packed")
    assert m.bandwidth_gbs > 0
