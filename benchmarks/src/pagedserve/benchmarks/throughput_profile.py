"""`bench throughput --profile`: where a decode step of the run went, by component.

Two sources, both from the run's own engine:

1. The timed run itself: each step's time and the time inside the model runner's `execute`
   (throughput_engine.StepRecord.runner_seconds). What the step spent outside the runner is
   the engine's scheduling and bookkeeping ("scheduling + Python").
2. After the run, on the still-loaded engine: a decode step shaped like the run's (its median
   rows, its mean context per row) profiled op class by op class with `bench step-profile`'s
   ranges (step_profile.profile_steps; the fused layer halves run op by op there, so the
   profiled step is slower than the real one). Its shares of the runner's time are scaled to
   the measured runner share of the decode steps.

The synthetic step writes one token's K and V per row into the engine's pool after the timed
run, when no request holds a block; the engine is discarded right after.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

# Component -> the step profile's op classes (step_profile.PHASES) it sums.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "matmul (linears, LM head)": ("linear", "lm_head"),
    "attention (KV write, metadata, paged attention)": ("attention", "kv_write", "metadata"),
    "norms + activations (RMSNorm, rotary, SiLU x up)": ("rmsnorm", "rotary", "activation"),
    "sampling": ("sampling",),
    "runner Python (views, residual adds, the rest of execute)": ("other",),
}
OUTSIDE_RUNNER = "scheduling + Python (the engine outside the runner)"
PROFILED_STEPS = 4


def decode_shape(steps: Sequence[Any]) -> tuple[int, int]:
    """(rows, context tokens per row) of the run's typical decode step: the median rows, the
    mean context per row. (0, 0) without decode steps."""
    decode = [s for s in steps if s.kind == "decode"]
    if not decode:
        return 0, 0
    rows = round(statistics.median(s.num_batched_tokens for s in decode))
    context = sum(s.context_tokens for s in decode) // max(1, sum(s.num_batched_tokens for s in decode))
    return max(1, rows), max(2, context)


def runner_share(steps: Sequence[Any]) -> float:
    """The share of the decode steps' time spent inside the runner (1.0 where it was not timed)."""
    decode = [s for s in steps if s.kind == "decode"]
    total = sum(s.seconds for s in decode)
    inside = sum(s.runner_seconds for s in decode)
    return inside / total if total and inside else 1.0


def component_shares(phases: dict[str, dict[str, float]], inside: float) -> dict[str, float]:
    """COMPONENTS' shares of a decode step: each op class's share of the profiled runner step
    times the runner's share of the measured step; the rest is OUTSIDE_RUNNER."""
    out = {name: inside * sum(phases[k]["share"] for k in keys) for name, keys in COMPONENTS.items()}
    out[OUTSIDE_RUNNER] = 1.0 - inside
    return out


def profile_probe(llm: Any, steps: Sequence[Any]) -> dict[str, Any]:
    """run_engine probe: the decode step's components (module docstring)."""
    import torch

    from pagedserve.benchmarks.step_profile import profile_steps, synthetic_step

    rows, context = decode_shape(steps)
    if not rows:
        return {}
    runner = llm.engine.runner
    bs = runner.block_size
    # Fit the pool: shorter contexts rather than fewer rows (rows set the matmuls' shape).
    context = min(context, max(2, llm.engine.budget.num_blocks // rows * bs))
    vocab = int(runner.model.config.vocab_size)
    step = synthetic_step("profile-", rows, context, 1, 0, bs, vocab, seed=0)
    with torch.inference_mode():
        # Twice, keeping the faster: on a shared machine a busy spell only ever slows a profile.
        prof = min(
            (profile_steps(runner, step, PROFILED_STEPS) for _ in range(2)), key=lambda p: p["step_ms"]
        )
    decode = [s for s in steps if s.kind == "decode"]
    inside = runner_share(steps)
    return {
        "rows": rows,
        "context": context,
        "profiled_step_ms": prof["step_ms"],
        "measured_decode_step_ms": 1e3 * sum(s.seconds for s in decode) / len(decode),
        "runner_share": inside,
        "op_classes": prof["phases"],
        "components": component_shares(prof["phases"], inside),
    }


def profile_table(profile: dict[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """Title, header, rows and notes of the component table."""
    step_ms = profile["measured_decode_step_ms"]
    rows = [
        [name, f"{100 * share:.1f} %", f"{share * step_ms:.2f}"]
        for name, share in profile["components"].items()
    ]
    notes = [
        f"a decode step of {profile['rows']} rows x {profile['context']} context tokens, profiled after the "
        f"timed run ({profile['profiled_step_ms']:.1f} ms under the profiler, the layer halves op by op); "
        f"shares scaled to the run's decode steps ({step_ms:.2f} ms each, "
        f"{100 * profile['runner_share']:.1f} % of it inside the runner)",
    ]
    return "Where a decode step goes (--profile)", ["component", "share", "ms per step"], rows, notes
