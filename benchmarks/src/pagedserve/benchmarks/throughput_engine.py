"""`bench throughput`, our engine's side: one timed run of the workload through `LLM`, step by
step (what each step scheduled, its time and its linear shapes), and the per-phase figures."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.benchmarks.common import (
    engine_from_args,
    kernel_selection,
)
from pagedserve.benchmarks.peers import check_lengths
from pagedserve.benchmarks.roofline import FP32_BYTES, LinearShapes


# -- our engine --------------------------------------------------------------------------------
@dataclass
class StepRecord:
    kind: str  # "decode" | "prefill" | "mixed" (| "unknown" without the scheduler hook)
    seconds: float
    num_batched_tokens: int
    num_sampled: int
    num_seqs: int
    num_preempted: int
    # Tokens whose K and V the step's attention reads: per scheduled sequence its length after
    # this step (cached + computed + new tokens). 0 without the scheduler hook.
    context_tokens: int = 0
    # (query, key) pairs the attention scores, causal: the context_tokens of a decode step.
    attention_pairs: int = 0
    # Time inside the model runner's execute (the forward and sampling); the rest of the step is
    # the engine's scheduling and bookkeeping. 0 where the engine has no runner to time.
    runner_seconds: float = 0.0


@dataclass
class PhaseStats:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    sampled: int = 0
    flops: int = 0

    def add(self, s: StepRecord, flops: int) -> None:
        self.steps += 1
        self.seconds += s.seconds
        self.tokens += s.num_batched_tokens
        self.sampled += s.num_sampled
        self.flops += flops

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class EngineRun:
    load_seconds: float
    warmup_seconds: float
    total_seconds: float
    outputs: list[list[int]]
    steps: list[StepRecord]
    num_preemptions: int
    generate_seconds: float | None = None  # --also-generate
    classified_by: str = "scheduler"
    kv_element_bytes: int = FP32_BYTES  # the engine's KV-cache element size
    kernels: list[dict[str, Any]] = field(default_factory=list)  # common.kernel_selection
    probes: dict[str, Any] = field(default_factory=dict)  # run_engine's `probes`, by name


@dataclass(frozen=True)
class Scheduled:
    """What a step's SchedulerOutput says of its shape (see StepRecord)."""

    kind: str
    num_seqs: int
    context_tokens: int
    attention_pairs: int


def _classify(scheduled: Any) -> Scheduled:
    """The shape of a SchedulerOutput, read before the step mutates the requests: at schedule
    time `num_computed_tokens` already counts the prefix-cache hits of a joining request."""
    decode = prefill = context = pairs = 0
    for item in scheduled.scheduled:
        if item.num_new_tokens == 1 and item.samples:
            decode += 1
        else:
            prefill += 1
        cached, new = item.request.num_computed_tokens, item.num_new_tokens
        context += cached + new
        # New token j (1-based) attends to the cached tokens and new tokens 1..j.
        pairs += new * cached + new * (new + 1) // 2
    kind = "decode" if not prefill else ("prefill" if not decode else "mixed")
    return Scheduled(kind, decode + prefill, context, pairs)


def _kv_element_bytes(engine: Any) -> int:
    """The engine's KV-cache element size (its budget's shape), fp32 where it has none."""
    shape = getattr(getattr(engine, "budget", None), "shape", None)
    return int(getattr(shape, "bytes_per_element", FP32_BYTES))


def run_engine(
    args: argparse.Namespace,
    model: str,
    prompts: list[list[int]],
    lengths: list[int],
    make_bar: Callable[[], Any] | None = None,
    probes: dict[str, Callable[[Any, list[StepRecord]], Any]] | None = None,
) -> EngineRun:
    """Our engine on the workload; `make_bar` makes a tqdm-like object just before the timed
    run (after load and warm-up, so its rate is the run's), advanced per finished request.
    Each of `probes` is called after the timed run with the `LLM` and the steps, while the
    engine is still loaded (what it returns lands in EngineRun.probes)."""
    from pagedserve.dataplane import SamplingParams

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    t = time.perf_counter()
    llm = engine_from_args(args, model, enable_prefix_caching=not args.no_prefix_caching)
    load_s = time.perf_counter() - t

    t = time.perf_counter()
    warm = llm.generate(prompts[:2], params(4), use_tqdm=False)
    warm_s = time.perf_counter() - t
    if any(len(o.token_ids) != 4 for o in warm):
        raise RuntimeError(f"warm-up produced lengths {[len(o.token_ids) for o in warm]}, expected 4")
    # The measured run must not reuse the warm-up's blocks: hits come only from within the workload.
    llm.reset_prefix_cache()

    generate_s = None
    if args.also_generate:
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(n) for n in lengths], use_tqdm=False)
        generate_s = time.perf_counter() - t
        check_lengths("LLM.generate", [o.token_ids for o in outs], lengths)

    engine = llm.engine
    # Capture each step's scheduler output to classify it (instance attribute: no engine edit).
    pending: list[Scheduled] = []
    scheduler = getattr(engine, "scheduler", None)
    original = getattr(scheduler, "schedule", None)
    hooked = original is not None

    if hooked:

        def schedule_and_record() -> Any:
            out = original()  # type: ignore[misc]
            pending.append(_classify(out))
            return out

        scheduler.schedule = schedule_and_record  # type: ignore[union-attr]

    # Time the runner inside each step the same way (instance attribute: no engine edit).
    runner = getattr(engine, "runner", None)
    execute = getattr(runner, "execute", None)
    in_runner: list[float] = []
    if execute is not None:

        def timed_execute(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return execute(*a, **kw)
            finally:
                in_runner.append(time.perf_counter() - t)

        runner.execute = timed_execute  # type: ignore[union-attr]

    steps: list[StepRecord] = []
    bar = make_bar() if make_bar is not None else None
    try:
        t0 = time.perf_counter()
        requests = [engine.add_request(p, params(n)) for p, n in zip(prompts, lengths, strict=True)]
        while engine.has_unfinished_requests():
            in_runner.clear()
            s0 = time.perf_counter()
            result = engine.step()
            s1 = time.perf_counter()
            if bar is not None and result.finished:
                bar.update(len(result.finished))
            if pending:
                shape = pending.pop()
                pending.clear()
            else:  # no hook: a step is decode-only when every batched token was sampled
                sampled = len(result.new_tokens)
                kind = "decode" if result.num_batched_tokens == sampled else "unknown"
                shape = Scheduled(kind, sampled, 0, 0)
            steps.append(
                StepRecord(
                    shape.kind,
                    s1 - s0,
                    result.num_batched_tokens,
                    len(result.new_tokens),
                    shape.num_seqs,
                    result.num_preempted,
                    shape.context_tokens,
                    shape.attention_pairs,
                    sum(in_runner),
                )
            )
            if result.num_batched_tokens == 0 and engine.has_unfinished_requests():
                raise RuntimeError("engine.step() made no progress with requests pending")
        total_s = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        if hooked:
            del scheduler.schedule  # type: ignore[union-attr]
        if execute is not None:
            del runner.execute  # type: ignore[union-attr]

    outputs = [list(r.output_token_ids) for r in requests]
    check_lengths("engine", outputs, lengths)
    reasons = {str(r.finish_reason) for r in requests}
    if reasons != {"length"}:
        print(f"warning: engine finish reasons {sorted(reasons)} (expected only 'length')", file=sys.stderr)
    preemptions = sum(int(getattr(r, "num_preemptions", 0)) for r in requests)
    kv_element_bytes = _kv_element_bytes(engine)
    kernels = kernel_selection(engine)
    probed = {name: probe(llm, steps) for name, probe in (probes or {}).items()}
    del llm, engine, requests
    gc.collect()
    return EngineRun(
        load_s,
        warm_s,
        total_s,
        outputs,
        steps,
        preemptions,
        generate_s,
        "scheduler" if hooked else "step-result",
        kv_element_bytes,
        kernels,
        probed,
    )


def phase_stats(steps: Sequence[StepRecord], shapes: LinearShapes) -> dict[str, PhaseStats]:
    phases = {"all": PhaseStats(), "decode": PhaseStats(), "prefill": PhaseStats()}
    for s in steps:
        flops = shapes.step_flops(s.num_batched_tokens, s.num_sampled)
        phases["all"].add(s, flops)
        # Mixed steps count as prefill: their cost is dominated by the prompt chunk.
        phases["decode" if s.kind == "decode" else "prefill"].add(s, flops)
    return phases
