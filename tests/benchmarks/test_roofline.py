"""The roofline: the machine's limits (compute peak, read bandwidth) and the engine's step
classes placed against them: linears (weights) plus attention (the KV cache's context)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pagedserve.benchmarks.roofline import (
    LinearShapes,
    MachineLimits,
    decode_curve,
    linear_shapes,
    measure_machine,
    roofline_by_class,
    roofline_by_decode_rows,
)
from pagedserve.dataplane.config import SchedulerConfig

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
    context_tokens: int = 0
    attention_pairs: int = 0


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


# -- attention: KV-cache reads and QK^T / PV FLOPs -------------------------------------------------
def test_attention_shape_comes_from_the_config() -> None:
    shapes = linear_shapes(CFG)
    assert (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim) == (2, 1, 2)
    # K and V x 3 layers x 1 kv head x 2 dims = 12 elements per token
    assert shapes.kv_bytes_per_token() == 48
    assert shapes.step_kv_bytes(10) == 480
    assert shapes.step_kv_bytes(10, element_bytes=2) == 240
    assert shapes.step_kv_bytes(10, element_bytes=1) == 120
    # QK^T and PV: 2 x 2 FLOPs per head-dim per head, 2 heads, 3 layers
    assert shapes.attention_flops_per_pair == 48
    assert shapes.step_attention_flops(1275) == 61200
    assert shapes.step_attention_flops(0) == 0


def test_smollm2_fp32_cache_is_46080_bytes_per_token() -> None:
    cfg = SimpleNamespace(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        num_hidden_layers=30,
        vocab_size=49152,
    )
    shapes = linear_shapes(cfg)
    assert shapes.kv_bytes_per_token() == 46080
    # a decode step of 34 rows at 230 tokens of context each
    assert shapes.step_kv_bytes(34 * 230) == 360_345_600
    assert shapes.step_attention_flops(34 * 230) == 4 * 30 * 9 * 64 * 7820


def test_shapes_without_attention_count_none() -> None:
    shapes = LinearShapes((("q", 4, 4),), 2, (4, 10))
    assert shapes.step_kv_bytes(100) == 0
    assert shapes.step_attention_flops(100) == 0


def test_step_time_adds_the_attention_phase_to_the_linears() -> None:
    # linears bandwidth-bound (1 MB: 0.1 ms), attention compute-bound (1 GFLOP: 10 ms vs 0.1 ms)
    assert MACHINE.step_seconds(10**6, 10**6, 10**9, 10**6) == pytest.approx(0.0101)
    # linears compute-bound (10 ms), attention bandwidth-bound (100 MB of KV: 10 ms vs 0.01 ms)
    assert MACHINE.step_seconds(10**9, 10**6, 10**6, 10**8) == pytest.approx(0.02)
    # no attention work: the linears alone, as before
    assert (
        MACHINE.step_seconds(10**9, 10**6, 0, 0) == MACHINE.step_seconds(10**9, 10**6) == pytest.approx(0.01)
    )


def test_step_classes_count_each_steps_kv_reads_and_attention_flops() -> None:
    shapes = linear_shapes(CFG)
    steps = [
        FakeStep("decode", 2, 2, 1.0, context_tokens=10, attention_pairs=10),
        FakeStep("decode", 6, 6, 3.0, context_tokens=40, attention_pairs=40),
        # a 50-token prompt: query j attends to keys 1..j, 50 x 51 / 2 pairs
        FakeStep("prefill", 50, 0, 2.0, context_tokens=50, attention_pairs=1275),
        # a decode at 30 tokens and a 19-token chunk on 10 cached: 30 + 19 x 10 + 19 x 20 / 2 pairs
        FakeStep("mixed", 20, 1, 2.0, context_tokens=30 + 29, attention_pairs=410),
    ]
    classes = roofline_by_class(shapes, MACHINE, steps)
    dec, pre = classes["decode"], classes["prefill"]
    # decode, linears: 1888 B of weights at 10 GB/s both times (the FLOPs are below the line);
    # attention: 480 B and 1920 B of KV at 10 GB/s
    assert dec.linear_roofline_seconds == pytest.approx(2 * 1.888e-7)
    assert dec.roofline_seconds == pytest.approx(2 * 1.888e-7 + 4.8e-8 + 1.92e-7)
    assert (dec.kv_bytes, dec.attention_flops, dec.mean_context_tokens) == (2400, 2400, 25.0)
    assert dec.fraction == pytest.approx(6.176e-7 / 4.0)
    assert dec.linear_fraction == pytest.approx(3.776e-7 / 4.0)
    assert dec.flops == 1888 + 5664  # linear FLOPs only, as before
    assert dec.roofline_gflops == pytest.approx(7552 / 6.176e-7 / 1e9)
    assert dec.linear_roofline_gflops == pytest.approx(7552 / 3.776e-7 / 1e9)
    # prefill: linears 43.2 kFLOP at 100 GFLOP/s, then 1888 B of weights; attention 61.2 kFLOP
    # at the peak (compute-bound), then 2832 B of KV at 10 GB/s
    assert pre.linear_roofline_seconds == pytest.approx(4.32e-7 + 1.888e-7)
    assert pre.roofline_seconds == pytest.approx(4.32e-7 + 6.12e-7 + 1.888e-7 + 2.832e-7)
    assert (pre.kv_bytes, pre.attention_flops, pre.mean_context_tokens) == (48 * 109, 48 * 1685, 54.5)


def test_decode_steps_split_into_row_bands_that_add_up_to_the_class() -> None:
    shapes = linear_shapes(CFG)
    steps = [
        FakeStep("decode", 2, 2, 1.0, context_tokens=10, attention_pairs=10),
        FakeStep("decode", 8, 8, 2.0, context_tokens=40, attention_pairs=40),
        FakeStep("decode", 9, 9, 3.0, context_tokens=90, attention_pairs=90),
        FakeStep("decode", 64, 64, 4.0, context_tokens=640, attention_pairs=640),
        FakeStep("decode", 65, 65, 5.0, context_tokens=650, attention_pairs=650),
        FakeStep("prefill", 50, 0, 2.0, context_tokens=50, attention_pairs=1275),
        FakeStep("mixed", 20, 1, 2.0, context_tokens=59, attention_pairs=410),
    ]
    bands = roofline_by_decode_rows(shapes, MACHINE, steps)
    # the 17-32 band has no step and is left out; prefill and mixed steps are in none
    assert [(b.kind, b.steps, b.seconds) for b in bands] == [
        ("decode 1-8 rows", 2, 3.0),
        ("decode 9-16 rows", 1, 3.0),
        ("decode 33-64 rows", 1, 4.0),
        ("decode 65+ rows", 1, 5.0),
    ]
    # each band is the decode class's roofline over its own steps
    first = roofline_by_class(shapes, MACHINE, steps[:2])["decode"]
    assert dataclasses.replace(bands[0], kind="decode") == first
    # 9 rows: linears 9 x 944 + 9 x 80 FLOP (9.216 kFLOP, 9.2e-8 s) < 1888 B (1.888e-7 s);
    # attention 90 x 48 FLOP (4.3e-8 s) < 90 x 48 B of KV (4.32e-7 s)
    assert bands[1].roofline_seconds == pytest.approx(1.888e-7 + 4.32e-7)
    decode = roofline_by_class(shapes, MACHINE, steps)["decode"]
    assert sum(b.roofline_seconds for b in bands) == pytest.approx(decode.roofline_seconds)
    assert sum(b.seconds for b in bands) == pytest.approx(decode.seconds)


def test_no_context_tokens_gives_the_linears_only_roofline() -> None:
    shapes = linear_shapes(CFG)
    steps = [FakeStep("decode", 2, 2, 1.0), FakeStep("decode", 6, 6, 3.0), FakeStep("prefill", 50, 0, 2.0)]
    classes = roofline_by_class(shapes, MACHINE, steps)
    assert classes["decode"].roofline_seconds == classes["decode"].linear_roofline_seconds
    assert classes["decode"].roofline_seconds == pytest.approx(2 * 1.888e-7)
    assert classes["prefill"].roofline_seconds == classes["prefill"].linear_roofline_seconds
    assert classes["prefill"].roofline_seconds == pytest.approx(4.32e-7)
    assert (classes["decode"].kv_bytes, classes["decode"].attention_flops) == (0, 0)


def test_kv_element_size_scales_the_kv_reads() -> None:
    shapes = linear_shapes(CFG)
    step = FakeStep("decode", 1, 1, 1.0, context_tokens=1000, attention_pairs=1000)
    fp32 = roofline_by_class(shapes, MACHINE, [step])["decode"]
    fp8 = roofline_by_class(shapes, MACHINE, [step], kv_element_bytes=1)["decode"]
    assert (fp32.kv_bytes, fp8.kv_bytes) == (48_000, 12_000)
    # linears: 944 FLOP vs 1888 B -> 1.888e-7 s; attention: 48 kFLOP (4.8e-7 s) vs 48 kB (4.8e-6 s)
    # at fp32, vs 12 kB (1.2e-6 s) at fp8
    assert fp32.roofline_seconds == pytest.approx(1.888e-7 + 4.8e-6)
    assert fp8.roofline_seconds == pytest.approx(1.888e-7 + 1.2e-6)


# -- context tokens from the scheduler's real output ---------------------------------------------
def test_classify_sums_context_and_pairs_of_a_real_schedule() -> None:
    from pagedserve.benchmarks.throughput_engine import Scheduled, _classify
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
    from pagedserve.dataplane.scheduler import Request, Scheduler

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, watermark=0.0)
    sched = Scheduler(KVCacheManager(BlockPool(16), 4), config, 256)  # block 4, budget 8 tokens

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=8), eos_token_id=None)

    sched.add_request(request("a", [10, 11, 12, 13, 14, 15]))
    sched.add_request(request("b", [20, 21, 22, 23, 24]))
    out = sched.schedule()
    # a: its 6 prompt tokens (21 pairs); b: the first 2 of its 5 (budget), 3 pairs
    assert _classify(out) == Scheduled("prefill", 2, 8, 24)
    sched.update_from_output(out, {"a": 7})

    # c shares a's first block (4 tokens, cached once a's KV was written)
    sched.add_request(request("c", [10, 11, 12, 13, 30, 31]))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 3), ("c", 2)]
    # a decodes at 7 tokens; b's 3 new on 2 cached read 5 (3 x 2 + 6 pairs); c's 2 new on
    # 4 cached by the prefix cache read 6 (2 x 4 + 3 pairs)
    assert _classify(out) == Scheduled("mixed", 3, 7 + 5 + 6, 7 + 12 + 11)
    sched.update_from_output(out, {"a": 7, "b": 7, "c": 7})

    out = sched.schedule()
    assert _classify(out) == Scheduled("decode", 3, 8 + 6 + 7, 8 + 6 + 7)
