"""Offline throughput: our paged engine vs transformers' static batching, and the matmul roofline.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower, see /work/shared/PEERS.md "Contention"):

    .venv/bin/python -m benchmarks.offline_throughput --json benchmarks/results/offline_throughput.json

Quick plumbing check (seconds, numbers meaningless):

    .venv/bin/python -m benchmarks.offline_throughput --num-prompts 4 --max-output 8 --peer-batch-size 4

What it does, in one process and strictly one phase after another:

1. Workload (`benchmarks.workloads`): `--num-prompts` chat prompts of 20-300 tokens (the
   model's chat template, ~10k prompt tokens for 64) and one output length per request spread
   over [`--min-output`, `--max-output`]; greedy, `ignore_eos`, so every request produces
   exactly its length. Torch uses `--threads` threads.
2. Our engine: `LLM(...)` is built (not timed), warmed up with a 2-prompt, 4-token `generate`,
   then THE measured run drives `llm.engine` directly: `add_request` for all prompts, then
   `step()` until done, timing every step with `time.perf_counter`. Each step is classified
   from the scheduler's output (captured by wrapping `engine.scheduler.schedule` on this
   instance only): `decode` (every scheduled request computes 1 token and samples),
   `prefill` (none does) or `mixed`. Every output is checked to have its requested length.
   `--also-generate` additionally times `llm.generate` on the same workload.
3. Roofline: the model's linear layers per token (q, k, v, o, gate, up, down per layer, from
   the config) plus the LM head for sampled rows only, run as plain `torch.matmul(x, W.T)` on
   fresh fp32 weights of the same shapes (distinct per layer, like the model), timed as a
   whole layer stack. Measured at the engine's mean decode row count (mean sequences per
   decode-only step: the roofline the goal is checked against), at several row counts to
   give a step-by-step decode roofline time, and at the mean prefill step size.
4. Peer: transformers `AutoModelForCausalLM` (fp32, sdpa) `generate`, batches of
   `--peer-batch-size` prompts in workload order, left padding, each batch generating its
   longest request's length (greedy, EOS disabled so it never stops early; `min_new_tokens`
   equal to the length): what a user of plain transformers gets. Useful tokens count each
   request's own length only. Greedy agreement: the fraction of requests whose tokens equal
   the peer's first-own-length tokens (fp32 greedy on both sides: expect ~100%; left padding
   can flip a rare near-tie).

Reported: useful output tok/s for both and the ratio (goal >= 2.0x), our total/decode/prefill
time, matmul GFLOP/s achieved in decode and prefill steps vs the roofline (goal: decode >= 60%
of the roofline at the mean decode row count). `--json PATH` writes everything, steps included.
The roofline is plain `torch.matmul` as the issue defines it; the engine's linears use
oneDNN-prepacked weights (`dataplane/runner/cpu_linear.py`), which beat plain matmul at
decode row counts, so the achieved fraction can exceed 100%.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import default_model, load_note, phase, warn_if_busy
from benchmarks.workloads import chat_prompts, describe, output_lengths

GOAL_RATIO = 2.0
GOAL_ROOFLINE = 0.60


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


# -- our engine --------------------------------------------------------------------------------
@dataclass
class StepRecord:
    kind: str  # "decode" | "prefill" | "mixed" (| "unknown" without the scheduler hook)
    seconds: float
    num_batched_tokens: int
    num_sampled: int
    num_seqs: int
    num_preempted: int


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


def _classify(scheduled: Any) -> tuple[str, int]:
    """(kind, num_seqs) of a SchedulerOutput, read before the step mutates the requests."""
    decode = prefill = 0
    for item in scheduled.scheduled:
        if item.num_new_tokens == 1 and item.samples:
            decode += 1
        else:
            prefill += 1
    kind = "decode" if not prefill else ("prefill" if not decode else "mixed")
    return kind, decode + prefill


def run_engine(
    args: argparse.Namespace, model: str, prompts: list[list[int]], lengths: list[int]
) -> EngineRun:
    from dataplane import LLM, SamplingParams

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    t = time.perf_counter()
    llm = LLM(
        model,
        dtype="float32",
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=int(args.kv_cache_gib * 2**30),
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
    )
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
        _check_lengths("LLM.generate", [o.token_ids for o in outs], lengths)

    engine = llm.engine
    # Capture each step's scheduler output to classify it (instance attribute: no engine edit).
    pending: list[tuple[str, int]] = []
    scheduler = getattr(engine, "scheduler", None)
    original = getattr(scheduler, "schedule", None)
    hooked = original is not None

    if hooked:

        def schedule_and_record() -> Any:
            out = original()  # type: ignore[misc]
            pending.append(_classify(out))
            return out

        scheduler.schedule = schedule_and_record  # type: ignore[union-attr]

    steps: list[StepRecord] = []
    try:
        t0 = time.perf_counter()
        requests = [engine.add_request(p, params(n)) for p, n in zip(prompts, lengths, strict=True)]
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            result = engine.step()
            s1 = time.perf_counter()
            if pending:
                kind, seqs = pending.pop()
                pending.clear()
            else:  # no hook: a step is decode-only when every batched token was sampled
                sampled = len(result.new_tokens)
                kind = "decode" if result.num_batched_tokens == sampled else "unknown"
                seqs = sampled
            steps.append(
                StepRecord(
                    kind,
                    s1 - s0,
                    result.num_batched_tokens,
                    len(result.new_tokens),
                    seqs,
                    result.num_preempted,
                )
            )
            if result.num_batched_tokens == 0 and engine.has_unfinished_requests():
                raise RuntimeError("engine.step() made no progress with requests pending")
        total_s = time.perf_counter() - t0
    finally:
        if hooked:
            del scheduler.schedule  # type: ignore[union-attr]

    outputs = [list(r.output_token_ids) for r in requests]
    _check_lengths("engine", outputs, lengths)
    reasons = {str(r.finish_reason) for r in requests}
    if reasons != {"length"}:
        print(f"warning: engine finish reasons {sorted(reasons)} (expected only 'length')", file=sys.stderr)
    preemptions = sum(int(getattr(r, "num_preemptions", 0)) for r in requests)
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
    )


def _check_lengths(who: str, outputs: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
    bad = [(i, len(o), n) for i, (o, n) in enumerate(zip(outputs, lengths, strict=True)) if len(o) != n]
    if bad:
        raise RuntimeError(f"{who}: {len(bad)} outputs have the wrong length (index, got, wanted): {bad[:5]}")


def phase_stats(steps: Sequence[StepRecord], shapes: LinearShapes) -> dict[str, PhaseStats]:
    phases = {"all": PhaseStats(), "decode": PhaseStats(), "prefill": PhaseStats()}
    for s in steps:
        flops = shapes.step_flops(s.num_batched_tokens, s.num_sampled)
        phases["all"].add(s, flops)
        # Mixed steps count as prefill: their cost is dominated by the prompt chunk.
        phases["decode" if s.kind == "decode" else "prefill"].add(s, flops)
    return phases


# -- roofline ----------------------------------------------------------------------------------
class MatmulStack:
    """Fresh fp32 weights of the model's linear shapes, one set per layer, run as x @ W.T."""

    def __init__(self, shapes: LinearShapes, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.layers = [
            [torch.randn(o, i, generator=gen) * 0.02 for _, i, o in shapes.layer]
            for _ in range(shapes.num_layers)
        ]
        hidden, vocab = shapes.lm_head
        self.lm_head = torch.randn(vocab, hidden, generator=gen) * 0.02
        self._gen = gen

    @torch.inference_mode()
    def time_stack(self, rows: int, lm_rows: int, reps: int) -> float:
        """Median seconds of one pass: every layer's linears on `rows` rows, LM head on `lm_rows`."""
        inputs = {i: torch.randn(rows, i, generator=self._gen) for _, i, _ in self.shapes.layer}
        head_in = torch.randn(max(lm_rows, 1), self.shapes.lm_head[0], generator=self._gen)
        dims = [i for _, i, _ in self.shapes.layer]

        def one_pass() -> None:
            for weights in self.layers:
                for d, w in zip(dims, weights, strict=True):
                    torch.matmul(inputs[d], w.T)
            if lm_rows:
                torch.matmul(head_in, self.lm_head.T)

        one_pass()  # warm-up
        times = []
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


def measure_roofline(
    shapes: LinearShapes, steps: Sequence[StepRecord], reps: int, skip_prefill: bool
) -> Roofline:
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


# -- transformers peer -------------------------------------------------------------------------
@dataclass
class PeerRun:
    load_seconds: float
    total_seconds: float
    outputs: list[list[int]]
    batch_seconds: list[float]
    generated_tokens: int  # including rows generated past their own length
    padded_prompt_tokens: int  # batch rows x longest prompt, summed over batches


def run_peer(model_path: Path, prompts: list[list[int]], lengths: list[int], batch_size: int) -> PeerRun:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    model.eval()  # type: ignore[no-untyped-call]
    load_s = time.perf_counter() - t
    gen_cfg = model.generation_config
    # Padding is masked out, so any id works; prefer the model's own pad, else its (first) EOS.
    pad_candidates = (gen_cfg.pad_token_id, model.config.pad_token_id, gen_cfg.eos_token_id)
    flat = [x[0] if isinstance(x, list) and x else x for x in pad_candidates]
    pad_id = next((int(x) for x in flat if isinstance(x, int)), 0)

    def generate(batch: Sequence[Sequence[int]], new_tokens: int) -> tuple[list[list[int]], int]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long)
        cfg = copy.deepcopy(gen_cfg)
        # Greedy, exactly `new_tokens` tokens: no EOS, so nothing stops early and nothing is
        # suppressed (our engine's ignore_eos keeps sampling EOS if it is the argmax).
        cfg.eos_token_id = None
        cfg.max_new_tokens = new_tokens
        cfg.min_new_tokens = new_tokens
        cfg.do_sample = False
        cfg.pad_token_id = pad_id
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist(), width * len(batch)

    warm, _ = generate(prompts[:2], 4)  # warm-up, like our engine's
    if any(len(w) != 4 for w in warm):
        raise RuntimeError("transformers warm-up did not produce 4 tokens per row")

    outputs: list[list[int]] = []
    batch_s: list[float] = []
    generated = padded = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        want = lengths[start : start + batch_size]
        tb = time.perf_counter()
        rows, width = generate(batch, max(want))
        batch_s.append(time.perf_counter() - tb)
        outputs.extend(row[:n] for row, n in zip(rows, want, strict=True))
        generated += max(want) * len(batch)
        padded += width
    total_s = time.perf_counter() - t0
    _check_lengths("transformers", outputs, lengths)
    return PeerRun(load_s, total_s, outputs, batch_s, generated, padded)


def agreement(ours: Sequence[Sequence[int]], peer: Sequence[Sequence[int]]) -> dict[str, Any]:
    identical = 0
    first_diff: list[int] = []
    matched = total = 0
    for a, b in zip(ours, peer, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        matched += n
        total += len(a)
        if n == len(a):
            identical += 1
        else:
            first_diff.append(n)
    return {
        "identical_requests": identical,
        "requests": len(ours),
        "fraction_identical": identical / len(ours) if ours else 0.0,
        "tokens_before_first_divergence": matched,
        "tokens": total,
        "first_divergence_positions": first_diff,
    }


# -- report ------------------------------------------------------------------------------------
def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "NOT MET")


def build_report(
    args: argparse.Namespace,
    model_path: Path,
    shapes: LinearShapes,
    prompts: list[list[int]],
    lengths: list[int],
    ours: EngineRun | None,
    roof: Roofline | None,
    peer: PeerRun | None,
    loads: dict[str, tuple[float, ...]],
) -> dict[str, Any]:
    useful = sum(lengths)
    rep: dict[str, Any] = {
        "command": " ".join(
            [Path(sys.executable).name, "-m", "benchmarks.offline_throughput", *sys.argv[1:]]
        ),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": loads},
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
        "model": str(model_path),
        "args": vars(args),
        "workload": {
            "summary": describe(prompts, lengths),
            "num_prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "useful_output_tokens": useful,
            "prompt_lengths": [len(p) for p in prompts],
            "output_lengths": lengths,
        },
        "flops": {
            "per_token_linear": shapes.flops_per_token,
            "per_sampled_row_lm_head": shapes.lm_head_flops_per_row,
            "shapes": shapes.describe(),
        },
    }
    goals: dict[str, Any] = {"ratio_goal": GOAL_RATIO, "roofline_goal": GOAL_ROOFLINE}
    if ours is not None:
        ph = phase_stats(ours.steps, shapes)
        rep["engine"] = {
            "load_seconds": ours.load_seconds,
            "warmup_seconds": ours.warmup_seconds,
            "total_seconds": ours.total_seconds,
            "output_tok_s": useful / ours.total_seconds,
            "total_tok_s": (useful + rep["workload"]["prompt_tokens"]) / ours.total_seconds,
            "generate_seconds": ours.generate_seconds,
            "generate_output_tok_s": useful / ours.generate_seconds if ours.generate_seconds else None,
            "num_preemptions": ours.num_preemptions,
            "classified_by": ours.classified_by,
            "phases": {k: {**asdict(v), "gflops": v.gflops} for k, v in ph.items()},
            "step_overhead_seconds": ours.total_seconds - ph["all"].seconds,
            "steps": [
                [s.kind, round(s.seconds, 6), s.num_batched_tokens, s.num_sampled, s.num_seqs]
                for s in ours.steps
            ],
            "steps_columns": ["kind", "seconds", "num_batched_tokens", "num_sampled", "num_seqs"],
        }
    if roof is not None and ours is not None:
        ph = phase_stats(ours.steps, shapes)
        r: dict[str, Any] = {
            "decode_rows": roof.decode_rows,
            "setup_seconds": roof.setup_seconds,
            "decode": asdict(roof.decode) if roof.decode else None,
            "decode_curve": [asdict(p) for p in roof.decode_curve],
            "prefill": asdict(roof.prefill) if roof.prefill else None,
        }
        if roof.decode and ph["decode"].seconds:
            r["decode_fraction"] = ph["decode"].gflops / roof.decode.gflops
            goals["roofline_met"] = r["decode_fraction"] >= GOAL_ROOFLINE
        if roof.decode_stepwise_seconds and ph["decode"].seconds:
            r["decode_stepwise_seconds"] = roof.decode_stepwise_seconds
            r["decode_stepwise_fraction"] = roof.decode_stepwise_seconds / ph["decode"].seconds
        if roof.prefill and ph["prefill"].seconds:
            r["prefill_fraction"] = ph["prefill"].gflops / roof.prefill.gflops
        rep["roofline"] = r
    if peer is not None:
        rep["transformers"] = {
            "batch_size": args.peer_batch_size,
            "load_seconds": peer.load_seconds,
            "total_seconds": peer.total_seconds,
            "output_tok_s": useful / peer.total_seconds,
            "generated_tokens": peer.generated_tokens,
            "padded_prompt_tokens": peer.padded_prompt_tokens,
            "batch_seconds": peer.batch_seconds,
        }
    if ours is not None and peer is not None:
        rep["ratio"] = peer.total_seconds / ours.total_seconds
        goals["ratio_met"] = rep["ratio"] >= GOAL_RATIO
        rep["greedy_agreement"] = agreement(ours.outputs, peer.outputs)
    rep["goals"] = goals
    return rep


def print_report(rep: dict[str, Any]) -> None:
    w = rep["workload"]
    print()
    print(
        f"== offline throughput: {Path(rep['model']).name}, fp32, {rep['torch']['threads']} torch threads =="
    )
    print(f"workload: {w['summary']}")
    print(f"load average at start/end: {rep['host']['loadavg']}")
    print()
    print(f"{'':38}{'useful out tok/s':>18}{'time (s)':>11}")
    eng, peer = rep.get("engine"), rep.get("transformers")
    if eng:
        print(
            f"{'pagedserve engine (step loop)':38}{eng['output_tok_s']:>18.1f}{eng['total_seconds']:>11.2f}"
        )
        if eng["generate_seconds"]:
            gen_s = eng["generate_seconds"]
            print(f"{'pagedserve LLM.generate':38}{eng['generate_output_tok_s']:>18.1f}{gen_s:>11.2f}")
    if peer:
        label = f"transformers generate (batch {peer['batch_size']})"
        print(f"{label:38}{peer['output_tok_s']:>18.1f}{peer['total_seconds']:>11.2f}")
    goals = rep["goals"]
    if "ratio" in rep:
        print(
            f"{'ratio engine / transformers':38}{rep['ratio']:>17.2f}x   goal >= {GOAL_RATIO}x: "
            f"{_met(goals.get('ratio_met'))}"
        )
    if eng:
        ph = eng["phases"]
        print()
        print(
            f"engine: {ph['all']['steps']} steps in {eng['total_seconds']:.2f} s "
            f"({eng['step_overhead_seconds']:.3f} s outside step()), {eng['num_preemptions']} preemptions; "
            f"steps classified by {eng['classified_by']}"
        )
        for name in ("decode", "prefill"):
            p = ph[name]
            if not p["steps"]:
                continue
            extra = "incl. mixed steps" if name == "prefill" else "decode-only steps"
            print(
                f"  {name:8} {p['seconds']:8.2f} s  {p['steps']:5d} steps  {p['tokens']:7d} tokens  "
                f"{1e3 * p['seconds'] / p['steps']:8.2f} ms/step  {p['tokens'] / p['steps']:7.1f} tokens/step"
                f"  ({extra})"
            )
    print()
    print(f"matmul FLOPs: {rep['flops']['shapes']}")
    roof = rep.get("roofline")
    if eng and roof:
        ph = eng["phases"]
        if roof["decode"]:
            d = roof["decode"]
            print(
                f"roofline (plain torch.matmul, same shapes, same run) at {d['rows']} rows "
                f"(mean decode batch): {d['gflops']:.1f} GFLOP/s"
            )
            curve = ", ".join(f"{p['rows']}:{p['gflops']:.0f}" for p in roof["decode_curve"])
            print(f"  roofline GFLOP/s by rows: {curve}")
            if "decode_fraction" in roof:
                print(
                    f"  decode achieved {ph['decode']['gflops']:.1f} GFLOP/s = "
                    f"{100 * roof['decode_fraction']:.1f}% of roofline   "
                    f"goal >= {100 * GOAL_ROOFLINE:.0f}%: {_met(goals.get('roofline_met'))}"
                )
            if "decode_stepwise_fraction" in roof:
                print(
                    f"  step by step: matmuls alone would take {roof['decode_stepwise_seconds']:.2f} s "
                    f"of the {ph['decode']['seconds']:.2f} s decode "
                    f"= {100 * roof['decode_stepwise_fraction']:.1f}%"
                )
        if roof["prefill"]:
            p = roof["prefill"]
            frac = roof.get("prefill_fraction")
            print(
                f"  prefill roofline at {p['rows']} rows: {p['gflops']:.1f} GFLOP/s; achieved "
                f"{ph['prefill']['gflops']:.1f} GFLOP/s" + (f" = {100 * frac:.1f}%" if frac else "")
            )
    agree = rep.get("greedy_agreement")
    if agree:
        print()
        print(
            f"greedy agreement with transformers: {agree['identical_requests']}/{agree['requests']} requests "
            f"identical ({100 * agree['fraction_identical']:.1f}%), "
            f"{agree['tokens_before_first_divergence']}/{agree['tokens']} tokens before the first divergence"
            + (
                f"; divergences at {agree['first_divergence_positions'][:10]}"
                if agree["first_divergence_positions"]
                else ""
            )
        )
    print()


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.offline_throughput",
        description="Our paged engine vs transformers static batching, plus the matmul roofline.",
    )
    ap.add_argument(
        "--model", default=default_model(), help="store name or local HF folder (default: %(default)s)"
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=20, help="shortest prompt target, tokens")
    ap.add_argument("--max-prompt", type=int, default=300, help="longest prompt target, tokens")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (both phases)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="engine KV cache size, GiB")
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn the engine's prefix caching off (on by default, as in vLLM; the chat template's "
        "shared system prompt is then computed once)",
    )
    ap.add_argument("--peer-batch-size", type=int, default=64)
    ap.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    ap.add_argument("--skip-engine", action="store_true", help="do not run our engine (peer only)")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--skip-prefill-roofline", action="store_true", help="skip the (slower) prefill point")
    ap.add_argument("--roofline-reps", type=int, default=3, help="timed passes per roofline point (median)")
    ap.add_argument("--also-generate", action="store_true", help="also time LLM.generate on the workload")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.min_output > args.max_output or args.min_output < 1:
        ap.error("need 1 <= --min-output <= --max-output")
    if args.min_prompt > args.max_prompt:
        ap.error("need --min-prompt <= --max-prompt")
    if args.num_prompts < 1 or args.peer_batch_size < 1 or args.threads < 1:
        ap.error("--num-prompts, --peer-batch-size and --threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from dataplane.models import resolve_model_path

    model_path = resolve_model_path(args.model)
    loads = {"start": load_note()}
    warn_if_busy(loads["start"])

    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    prompts = chat_prompts(tokenizer, args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output, args.seed)
    from transformers import AutoConfig

    shapes = linear_shapes(AutoConfig.from_pretrained(str(model_path), local_files_only=True))
    print(f"workload: {describe(prompts, lengths)}", file=sys.stderr)

    ours = roof = peer = None
    if not args.skip_engine:
        ours = phase("engine", lambda: run_engine(args, str(model_path), prompts, lengths))
        loads["after_engine"] = load_note()
        if not args.skip_roofline:
            roof = phase(
                "roofline",
                lambda: measure_roofline(shapes, ours.steps, args.roofline_reps, args.skip_prefill_roofline),
            )
    if not args.skip_peer:
        peer = phase("transformers", lambda: run_peer(model_path, prompts, lengths, args.peer_batch_size))
    loads["end"] = load_note()

    rep = build_report(args, model_path, shapes, prompts, lengths, ours, roof, peer, loads)
    print_report(rep)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        rep["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in rep["args"].items()}
        args.json.write_text(json.dumps(rep, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
