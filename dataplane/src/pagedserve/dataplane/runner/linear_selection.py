"""The load-time choice between our panel kernel and oneDNN for each fp32 CPU linear.

Why: the panel kernel (kernels/src/pagedserve/kernels/cpu/linear.cpp) beats oneDNN's packed linear on the decode
row counts of the CPUs it was tuned on, but a kernel is only as good as the chip it meets:
its first AVX2 build ran 2-8x behind oneDNN on a Zen 3. So at load, with `--cpu-linear
auto`, each distinct linear shape of the model is timed both ways at the row counts of
`ROW_BANDS` (decode batches of 1, 8, 32, 64 rows and a 256-row prefill chunk), on the model's
own weights, and the faster one serves that shape: the one whose geometric mean of time over
the row counts is lower. The table is logged (`cpu_kernels_selected`) with both times per
row count, and cached on disk per CPU, kernel build, thread count and model shapes, so a
restart does not time again.

Why one kernel per shape, not per row count: a row's result must not depend on what else
shares the step (a seeded request gives the same tokens whatever the batch). The panel
kernel is batch-invariant; switching kernels with the batch's row count would not be.

`panel` and `onednn` force one side (no timing). Shapes too small for a library call to pay
(`UNTIMED_MAX_ELEMENTS`) take the panel kernel untimed: they cost microseconds either way,
and the choice then cannot flip between runs on tiny models.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.common.log import get_logger
from pagedserve.dataplane.config import CPU_LINEAR_MODES
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.cpu_isa import cpu_model, cpu_report
from pagedserve.kernels.linear import pack_panels, pack_panels_bf16, panel_linear, panel_linear_bf16

log = get_logger(__name__)

# The row counts each shape is timed at.
ROW_BANDS = (1, 8, 32, 64, 256)
# Below this many weight elements a linear is not timed (module docstring).
UNTIMED_MAX_ELEMENTS = 1 << 17
# Up to this many of the model's weights of one shape are timed in turn, so the weights come
# from memory as in a real step (3 x 576 x 576 floats already exceed a core's L2).
TIMED_LAYERS = 3
# Alternating rounds per row count: at least REPEATS, and more (up to MAX_REPEATS) until each
# side's two best rounds agree within SETTLED_SPREAD. Why: noise only ever slows a round, so
# the best of a few is the kernel's time, unless every round was hit. On a shared 2-core
# machine a busy spell once made every round of three take 6-8 ms where 0.02-0.4 ms was
# right; that table chose oneDNN for a shape the panel kernel wins, which also kept the
# layer's fused MLP op from binding, and it was cached for every later start.
REPEATS = 3
MAX_REPEATS = 15
SETTLED_SPREAD = 1.25
CACHE_VERSION = 2


@dataclass(frozen=True)
class ShapeChoice:
    """One linear shape's timings (milliseconds per call, the best of REPEATS, per row count
    of ROW_BANDS; empty when untimed) and the kernel it uses: "panel" or "onednn"."""

    in_features: int
    out_features: int
    choice: str
    panel_ms: tuple[float, ...] = ()
    onednn_ms: tuple[float, ...] = ()
    reason: str = "timed"

    @property
    def speedup(self) -> float | None:
        """oneDNN's time over the panel kernel's, geometric mean over the row counts."""
        if not self.panel_ms:
            return None
        logs = [math.log(o / p) for p, o in zip(self.panel_ms, self.onednn_ms, strict=True)]
        return math.exp(sum(logs) / len(logs))


Shape = tuple[int, int]  # (in_features, out_features)


def linear_shapes(model: nn.Module) -> dict[Shape, list[nn.Linear]]:
    """The model's nn.Linear modules grouped by shape, in model order."""
    shapes: dict[Shape, list[nn.Linear]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            shapes.setdefault((module.in_features, module.out_features), []).append(module)
    return shapes


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed linear, as PackedLinear runs it (without bias: timing only)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out


def settled(samples: Sequence[float]) -> bool:
    """Whether the two best of these round times agree within SETTLED_SPREAD."""
    best = sorted(samples)[:2]
    return len(best) == 2 and best[1] <= best[0] * SETTLED_SPREAD


def time_shape(
    ops: CpuKernels,
    panels: Sequence[torch.Tensor],
    onednn: Sequence[torch.Tensor],
    shape: Shape,
    rows: int,
    repeats: int = REPEATS,
    bf16_weights: bool = False,
    max_repeats: int = MAX_REPEATS,
) -> tuple[float, float, bool]:
    """(panel, oneDNN) milliseconds per call at `rows` rows over the packed weights in turn,
    best of alternating rounds (so a burst of noise hits both sides alike): `repeats`, then
    more up to `max_repeats` until both sides have settled; and whether they did."""
    in_features, out_features = shape
    x = torch.randn(rows, in_features)
    linear = panel_linear_bf16 if bf16_weights else panel_linear

    def run_panel() -> None:
        for p in panels:
            linear(ops, x, p, out_features)

    def run_onednn() -> None:
        for w in onednn:
            onednn_linear(x, w)

    run_panel()  # warm: first-call allocations, page faults
    run_onednn()
    panel_s: list[float] = []
    onednn_s: list[float] = []
    while len(panel_s) < max(repeats, 1) or (
        len(panel_s) < max_repeats and not (settled(panel_s) and settled(onednn_s))
    ):
        panel_s.append(_time(run_panel))
        onednn_s.append(_time(run_onednn))
    ok = settled(panel_s) and settled(onednn_s)
    return min(panel_s) / len(panels) * 1e3, min(onednn_s) / len(onednn) * 1e3, ok


def choose_shape(
    ops: CpuKernels,
    shape: Shape,
    weights: Sequence[torch.Tensor],
    bf16_weights: bool = False,
    earlier: ShapeChoice | None = None,
) -> ShapeChoice:
    """Time one shape at every row count; oneDNN if it is faster over them (geometric mean),
    else the panel kernel. With `earlier` (a first pass of the same shape) each side's time per
    row count is the best of both passes."""
    in_features, out_features = shape
    if in_features * out_features < UNTIMED_MAX_ELEMENTS:
        return ShapeChoice(in_features, out_features, "panel", reason="small")
    timed = [w.detach() for w in weights[:TIMED_LAYERS]]
    pack = pack_panels_bf16 if bf16_weights else pack_panels
    panels = [pack(w, ops.panel_width) for w in timed]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in timed]
    panel_ms, onednn_ms, ok = zip(
        *(time_shape(ops, panels, onednn, shape, rows, bf16_weights=bf16_weights) for rows in ROW_BANDS),
        strict=True,
    )
    if earlier is not None and earlier.panel_ms:
        panel_ms = tuple(map(min, panel_ms, earlier.panel_ms))
        onednn_ms = tuple(map(min, onednn_ms, earlier.onednn_ms))
        ok = tuple(o or earlier.reason == "timed" for o in ok)
    timings = ShapeChoice(in_features, out_features, "panel", tuple(panel_ms), tuple(onednn_ms))
    speedup = timings.speedup
    assert speedup is not None
    return ShapeChoice(
        in_features,
        out_features,
        "panel" if speedup >= 1.0 else "onednn",
        tuple(round(t, 4) for t in panel_ms),
        tuple(round(t, 4) for t in onednn_ms),
        reason="timed" if all(ok) else "noisy",
    )


def selection_cache_dir() -> Path:
    """$PAGEDSERVE_CACHE_HOME, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve;
    the tables live in its cpu-linear/ folder."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_HOME")
    if explicit:
        return Path(explicit).expanduser() / "cpu-linear"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pagedserve" / "cpu-linear"


def selection_key(ops: CpuKernels, shapes: Sequence[Shape], bf16_weights: bool = False) -> str:
    """What the timings depend on: the CPU, the kernel build (its file: a changed source is a
    new build), torch and its threads, the ISA caps set on oneDNN and torch, and the shapes
    timed."""
    try:
        stat = os.stat(ops.library_path)
        build = f"{ops.library_path}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        build = ops.library_path
    parts = [
        f"v{CACHE_VERSION}",
        cpu_model(),
        json.dumps(cpu_report()["flags"]),
        ops.isa,
        build,
        torch.__version__,
        str(torch.get_num_threads()),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        os.environ.get("ATEN_CPU_CAPABILITY", ""),
        json.dumps(sorted(shapes)),
        json.dumps(ROW_BANDS),
        "bf16-weights" if bf16_weights else "fp32-weights",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _read_cache(path: Path) -> dict[Shape, ShapeChoice] | None:
    try:
        raw = json.loads(path.read_text())
        table = {}
        for entry in raw["shapes"]:
            choice = ShapeChoice(
                in_features=int(entry["in_features"]),
                out_features=int(entry["out_features"]),
                choice=str(entry["choice"]),
                panel_ms=tuple(float(t) for t in entry["panel_ms"]),
                onednn_ms=tuple(float(t) for t in entry["onednn_ms"]),
                reason=str(entry["reason"]),
            )
            if choice.choice not in ("panel", "onednn") or len(choice.panel_ms) not in (0, len(ROW_BANDS)):
                return None
            table[(choice.in_features, choice.out_features)] = choice
        return table
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: time again


def _write_cache(path: Path, table: dict[Shape, ShapeChoice]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"row_bands": ROW_BANDS, "shapes": [asdict(c) for c in table.values()]}))
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
    except OSError as exc:
        log.warning("cpu_kernels_cache_unwritable", path=str(path), error=str(exc))


def select_linears(
    model: nn.Module, ops: CpuKernels | None, mode: str = "auto", *, bf16_weights: bool = False
) -> dict[Shape, ShapeChoice]:
    """The kernel per shape for the fp32 CPU linears of `model` (not yet packed): the panel
    kernel (on bf16 weights with `bf16_weights`) or oneDNN's fp32 packed linear.

    ops None (the C++ kernels did not build) means oneDNN everywhere. Logs the table.
    """
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_MODES}, got {mode!r}")
    shapes = linear_shapes(model)
    forced = "onednn" if ops is None else (mode if mode != "auto" else None)
    source = "forced" if forced else "cache"
    started = time.perf_counter()
    if forced is not None:
        reason = "no C++ kernels" if ops is None else f"--cpu-linear {mode}"
        table = {(i, o): ShapeChoice(i, o, forced, reason=reason) for i, o in shapes}
    else:
        assert ops is not None
        path = selection_cache_dir() / f"{selection_key(ops, list(shapes), bf16_weights)}.json"
        cached = _read_cache(path)
        if cached is not None and set(cached) == set(shapes):
            table = cached
        else:
            source = "timed"
            table = {
                shape: choose_shape(ops, shape, [m.weight for m in mods], bf16_weights)
                for shape, mods in shapes.items()
            }
            # oneDNN wins are timed once more, later, and decided on the best of both passes:
            # a burst of other work is local in time, and a panel shape lost to oneDNN also
            # keeps its layer half off the fused C++ op.
            for shape, mods in shapes.items():
                if table[shape].choice == "onednn":
                    table[shape] = choose_shape(
                        ops, shape, [m.weight for m in mods], bf16_weights, earlier=table[shape]
                    )
            noisy = sorted(f"{i}x{o}" for (i, o), c in table.items() if c.reason == "noisy")
            if noisy:
                # Kept for this start only: the next start times again rather than trusting it.
                log.warning(
                    "cpu_kernels_timing_noisy",
                    shapes=noisy,
                    hint="other work slowed every timing round; the choice is not cached",
                )
            else:
                _write_cache(path, table)
    log.info(
        "cpu_kernels_selected",
        mode=mode,
        source=source,
        isa=None if ops is None else ops.isa,
        panel_weights="bfloat16" if bf16_weights else "float32",
        seconds=round(time.perf_counter() - started, 3),
        row_bands=list(ROW_BANDS),
        shapes=[
            {
                "shape": f"{c.in_features}x{c.out_features}",
                "layers": len(shapes[(c.in_features, c.out_features)]),
                "choice": c.choice,
                "panel_ms": list(c.panel_ms),
                "onednn_ms": list(c.onednn_ms),
                "onednn_over_panel": None if c.speedup is None else round(c.speedup, 3),
                "reason": c.reason,
            }
            for c in table.values()
        ],
    )
    return table
