"""The load-time choice between the panel kernel and oneDNN (dataplane/src/pagedserve/dataplane/runner/linear_selection.py).

A kernel made artificially slow must lose to oneDNN (and oneDNN made slow must lose to the
kernel): the choice follows the timings, not a preference. The table is cached per CPU,
build, threads and shapes, so a second load times nothing; forced modes time nothing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from torch import nn

from pagedserve.dataplane.config import ModelConfig, engine_config
from pagedserve.dataplane.runner import linear_selection
from pagedserve.dataplane.runner.cpu_linear import PackedLinear, PanelLinear, pack_linears
from pagedserve.dataplane.runner.linear_selection import ROW_BANDS, ShapeChoice, select_linears
from pagedserve.kernels.cpu_ext import CpuKernels, load_cpu_kernels

R = TypeVar("R")


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDSERVE_CACHE_HOME", str(tmp_path))
    return tmp_path / "cpu-linear"


@pytest.fixture(autouse=True)
def timings_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any two rounds count as settled, so the choice tests do not depend on this machine's
    load (the settling rule itself is tested on made-up timings below)."""
    monkeypatch.setattr(linear_selection, "SETTLED_SPREAD", float("inf"))


@pytest.fixture(scope="module")
def ops() -> CpuKernels:
    kernels = load_cpu_kernels(strict=True)
    assert kernels is not None
    return kernels


class Stack(nn.Module):
    """Three 512 x 512 layers (timed: above UNTIMED_MAX_ELEMENTS) and a small 64 x 32 one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.ModuleList(nn.Linear(512, 512) for _ in range(3))
        self.small = nn.Linear(64, 32, bias=False)


def slowed(fn: Callable[..., R], calls: list[int]) -> Callable[..., R]:
    """fn, then ~1 ms of waiting: slower than either kernel on a 512 x 512 layer at 256 rows."""

    def slow(*args: object) -> R:
        calls.append(1)
        out = fn(*args)
        end = time.perf_counter() + 1e-3
        while time.perf_counter() < end:
            pass
        return out

    return slow


def counting(fn: Callable[..., R], calls: list[int]) -> Callable[..., R]:
    def count(*args: object) -> R:
        calls.append(1)
        return fn(*args)

    return count


def test_a_slow_panel_kernel_falls_back_to_onednn(ops: CpuKernels) -> None:
    calls: list[int] = []
    slow_ops = dataclasses.replace(ops, panel_linear=slowed(ops.panel_linear, calls))
    model = Stack()
    table = select_linears(model, slow_ops, "auto")
    assert calls  # it timed
    big = table[(512, 512)]
    assert big.choice == "onednn" and big.reason == "timed"
    assert len(big.panel_ms) == len(big.onednn_ms) == len(ROW_BANDS)
    assert all(p > o for p, o in zip(big.panel_ms, big.onednn_ms, strict=True))
    assert big.speedup is not None and big.speedup < 1.0
    assert table[(64, 32)] == ShapeChoice(64, 32, "panel", reason="small")  # never timed

    x = torch.randn(5, 512)
    want = [layer(x) for layer in model.big]
    pack_linears(model, panel_ops=slow_ops, choices=table)
    assert all(isinstance(layer, PackedLinear) for layer in model.big)
    assert isinstance(model.small, PanelLinear)
    for layer, expected in zip(model.big, want, strict=True):
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_a_slow_onednn_keeps_the_panel_kernel(ops: CpuKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(linear_selection, "onednn_linear", slowed(linear_selection.onednn_linear, calls))
    table = select_linears(Stack(), ops, "auto")
    assert calls
    assert table[(512, 512)].choice == "panel"
    assert all(p < o for p, o in zip(table[(512, 512)].panel_ms, table[(512, 512)].onednn_ms, strict=True))


def test_the_choice_is_cached_and_a_restart_times_nothing(ops: CpuKernels, cache_home: Path) -> None:
    calls: list[int] = []
    counted = dataclasses.replace(ops, panel_linear=counting(ops.panel_linear, calls))
    first = select_linears(Stack(), counted, "auto")
    timed_calls = len(calls)
    assert timed_calls > 0
    files = list(cache_home.glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["row_bands"] == list(ROW_BANDS)
    assert {(s["in_features"], s["out_features"]) for s in stored["shapes"]} == {(512, 512), (64, 32)}

    second = select_linears(Stack(), counted, "auto")
    assert len(calls) == timed_calls  # read from the cache: no kernel call
    assert second == first

    files[0].write_text("{not json")  # damaged: timed again, and rewritten
    third = select_linears(Stack(), counted, "auto")
    assert len(calls) > timed_calls
    assert set(third) == set(first)
    assert json.loads(files[0].read_text())["row_bands"] == list(ROW_BANDS)


def test_other_shapes_or_threads_are_other_cache_entries(ops: CpuKernels) -> None:
    key = linear_selection.selection_key(ops, [(512, 512)])
    assert linear_selection.selection_key(ops, [(512, 512), (64, 32)]) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert linear_selection.selection_key(ops, [(512, 512)]) != key
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["panel", "onednn"])
def test_forced_modes_time_nothing(ops: CpuKernels, cache_home: Path, mode: str) -> None:
    calls: list[int] = []
    counted = dataclasses.replace(ops, panel_linear=counting(ops.panel_linear, calls))
    model = Stack()
    table = select_linears(model, counted, mode)
    assert not calls and not cache_home.exists()
    assert {c.choice for c in table.values()} == {mode}
    assert all(c.reason == f"--cpu-linear {mode}" for c in table.values())
    pack_linears(model, panel_ops=counted, choices=table)
    kind = PanelLinear if mode == "panel" else PackedLinear
    assert all(isinstance(m, kind) for m in (*model.big, model.small))


def test_without_cpp_kernels_everything_is_onednn() -> None:
    table = select_linears(Stack(), None, "auto")
    assert {c.choice for c in table.values()} == {"onednn"}
    assert {c.reason for c in table.values()} == {"no C++ kernels"}


def test_cpu_linear_is_validated_by_name() -> None:
    with pytest.raises(
        ValueError, match="cpu_linear must be one of \\('auto', 'panel', 'onednn'\\), got 'mkl'"
    ):
        ModelConfig(cpu_linear="mkl")
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        select_linears(Stack(), None, "mkl")
    assert engine_config(cpu_linear="onednn").model.cpu_linear == "onednn"
    assert ModelConfig().cpu_linear == "auto"


def test_bf16_weights_time_the_bf16_kernel_under_their_own_key(ops: CpuKernels, cache_home: Path) -> None:
    fp32_calls: list[int] = []
    bf16_calls: list[int] = []
    counted = dataclasses.replace(
        ops,
        panel_linear=counting(ops.panel_linear, fp32_calls),
        panel_linear_bf16=counting(ops.panel_linear_bf16, bf16_calls),
    )
    table = select_linears(Stack(), counted, "auto", bf16_weights=True)
    assert bf16_calls and not fp32_calls  # the kernel that will serve is the one timed
    assert table[(512, 512)].reason == "timed"
    assert linear_selection.selection_key(
        ops, [(512, 512)], bf16_weights=True
    ) != linear_selection.selection_key(ops, [(512, 512)])
    select_linears(Stack(), counted, "auto")  # fp32 weights: not the bf16 entry, timed afresh
    assert fp32_calls
    assert len(list(cache_home.glob("*.json"))) == 2


def made_up_timings(
    monkeypatch: pytest.MonkeyPatch, rounds: Callable[[int], tuple[float, float]]
) -> list[int]:
    """_time returns rounds(n) = (panel s, oneDNN s) for the n-th alternating round of each
    row count (the kernels still run); returns the round counts per row count."""
    counts: list[int] = []
    state = {"n": 0, "side": 0}

    def fake_time(fn: Callable[[], object]) -> float:
        fn()
        panel, onednn = rounds(state["n"])
        value = (panel, onednn)[state["side"]]
        if state["side"] == 1:
            state["n"] += 1
        state["side"] ^= 1
        return value

    real = linear_selection.time_shape

    def counted(*args: object, **kwargs: object) -> tuple[float, float, bool]:
        state["n"] = 0
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        counts.append(state["n"])
        return out

    monkeypatch.setattr(linear_selection, "_time", fake_time)
    monkeypatch.setattr(linear_selection, "time_shape", counted)
    monkeypatch.setattr(linear_selection, "SETTLED_SPREAD", 1.25)
    return counts


def test_timing_goes_on_until_both_sides_settle(
    ops: CpuKernels, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rounds 0-3 are slowed by noise (8 ms and more), from round 4 on the true times: panel 1 ms,
    # oneDNN 2 ms. Three rounds would have seen only noise and a tie.
    counts = made_up_timings(monkeypatch, lambda n: (8e-3 * 2**n, 8e-3 * 2**n) if n < 4 else (1e-3, 2e-3))
    table = select_linears(Stack(), ops, "auto")
    assert counts == [6] * len(ROW_BANDS)  # rounds 4 and 5 are the two that agree
    big = table[(512, 512)]
    assert big.choice == "panel" and big.reason == "timed"
    assert big.panel_ms == tuple(round(1e-3 / 3 * 1e3, 4) for _ in ROW_BANDS)  # per layer, of 3
    assert len(list(cache_home.glob("*.json"))) == 1


def test_timings_that_never_settle_are_used_once_and_not_cached(
    ops: CpuKernels, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every round twice the one before: no two agree within the spread.
    counts = made_up_timings(monkeypatch, lambda n: (1e-3 * 2**n, 2e-3 * 2**n))
    table = select_linears(Stack(), ops, "auto")
    assert counts == [linear_selection.MAX_REPEATS] * len(ROW_BANDS)
    assert table[(512, 512)].reason == "noisy" and table[(512, 512)].choice == "panel"
    assert list(cache_home.glob("*.json")) == []  # the next start times again


def test_a_onednn_win_is_timed_again_and_decided_on_the_best_of_both_passes(
    ops: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    # First pass: a busy spell makes the panel kernel look slower (3 ms vs 2 ms, settled);
    # second pass: the true times, panel 1 ms, oneDNN 2 ms.
    passes = {"n": 0}
    real = linear_selection.time_shape

    def by_pass(*args: object, **kwargs: object) -> tuple[float, float, bool]:
        real(*args, **kwargs)  # type: ignore[arg-type]
        passes["n"] += 1
        first = passes["n"] <= len(ROW_BANDS)
        return (3.0 if first else 1.0), 2.0, True

    monkeypatch.setattr(linear_selection, "time_shape", by_pass)
    table = select_linears(Stack(), ops, "auto")
    assert passes["n"] == 2 * len(ROW_BANDS)
    big = table[(512, 512)]
    assert (big.choice, big.reason) == ("panel", "timed")
    assert big.panel_ms == (1.0,) * len(ROW_BANDS) and big.onednn_ms == (2.0,) * len(ROW_BANDS)
