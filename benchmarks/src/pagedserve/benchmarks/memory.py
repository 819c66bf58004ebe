"""`pagedserve bench memory`: the PagedAttention paper's central claim, measured. Imports no torch.

The claim (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, arXiv:2309.06180): serving systems that pre-allocate a contiguous
`max_model_len` slice of KV memory per request store tokens in under 40% of it; paged
allocation brings that close to 97%.

A workload's real prompt and output lengths (a shipped `LengthTrace`) are replayed through
our own continuous-batching `Scheduler` and `KVCacheManager` / `BlockPool`, the objects the
server runs, with the model replaced by "every scheduled token is computed, every sampling
step yields a token". Two ways of handing out the same KV memory are compared:

- contiguous: every request reserves `max_model_len` slots up front, in one piece, the way
  servers without paging pre-allocate (the paper's "existing systems" baseline). This is exactly a
  block pool whose block size is `max_model_len`: one block per request, never a second one,
  never a preemption. The same scheduler drives it, so only the allocation differs.
- paged: our pool with `block_size` 8, 16 or 32; a request takes blocks as its tokens grow,
  and the scheduler preempts (recompute) when the pool runs dry, as the server does.

Prefix caching is off in both: this measures allocation alone (sharing only adds to paging's
advantage; `bench prefix-caching` measures that).

Every step, after the scheduler's output is applied, we take a snapshot of the running
requests: stored tokens S (KV actually written: each request's `num_computed_tokens`),
reserved slots R (the pool's referenced blocks x unit) and free slots. Over the steps of the
*saturated window* (steps at whose end some request is still waiting to be admitted; the
whole run when nothing ever waits), we report:

- KV utilization = sum S / sum R: of the slots reserved for requests, the share holding KV.
- internal fragmentation = 1 - utilization = reserved slots holding nothing, split into
  "never" (beyond the request's final length: never written) and "pending" (to be written
  by tokens the request has yet to generate).
- external fragmentation = KV memory in no allocatable unit: the pool's remainder smaller than
  one unit (memory mod `max_model_len` slots for contiguous, mod `block_size` for paged), as a
  share of the KV memory. With equal-size units nothing else can be stranded: any free unit
  serves any request. (Variable-size contiguous reservations would add holes between
  allocations; the paper's baseline reserves `max_model_len` for every request.)
- free while waiting = mean free slots / KV memory over the window: memory idle although
  requests wait (a prompt bigger than the free blocks, or the per-step token budget).
- concurrency: peak and mean running requests over the window; preemptions and the tokens
  they make the model compute again (as a share of the tokens computed once); steps.

Defaults: KV memory 2 GiB of the default model's fp32 KV (46,080 B/token: 46,603 token
slots, what `pagedserve` gets on a CPU by default); every trace is submitted `--repeat 4`
times at once so the pool stays saturated for most of the run; the scheduler's token budget
is the server's default (2048) and `max_num_seqs` is unlimited, so memory is the only limit.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.benchmarks.report import Report, fmt_pct
from pagedserve.benchmarks.traces import WORKLOADS, LengthTrace, load_trace
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.kvcache.budget import KV_DTYPE_BYTES, KVCacheShape, plan_kv_cache
from pagedserve.dataplane.scheduler import Request, Scheduler

# The default model's KV per token (SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64).
DEFAULT_SHAPE = KVCacheShape(num_layers=30, num_kv_heads=3, head_dim=64, bytes_per_element=4)
DEFAULT_KV_MEMORY = 2 * 2**30
# The PagedAttention paper's figures (arXiv:2309.06180): contiguous pre-allocation stores tokens in
# under 40% of the KV memory it reserves, paging in close to 97%.
PAPER_CONTIGUOUS_UTILIZATION = 0.40
PAPER_PAGED_UTILIZATION = 0.97


@dataclass(frozen=True)
class Allocation:
    """How KV memory is handed out: `unit` slots at a time (contiguous: unit = max_model_len)."""

    kind: str  # "contiguous" | "paged"
    unit: int

    @property
    def label(self) -> str:
        return "contiguous" if self.kind == "contiguous" else f"paged, block {self.unit}"


@dataclass
class ReplayResult:
    allocation: str
    unit: int
    max_model_len: int
    kv_slots: float  # KV memory / bytes per token
    num_units: int
    requests: int
    refused: int  # prompt >= max_model_len: the server refuses them at submission
    truncated: int  # prompt + output > max_model_len: stopped at max_model_len
    steps: int
    window_steps: int
    saturated: bool  # some request waited for admission at some step
    preemptions: int
    output_tokens: int
    computed_tokens: int  # every token the scheduler had computed, recomputation included
    recomputed_tokens: int  # KV computed more than once (after preemption): compute, not memory
    utilization: float
    internal_never: float
    internal_pending: float
    external: float
    free_while_waiting: float
    peak_running: int
    mean_running: float
    whole_run: dict[str, float] = field(default_factory=dict)  # the same ratios over every step

    @property
    def internal(self) -> float:
        return self.internal_never + self.internal_pending


class _Totals:
    """Sums of per-step snapshots."""

    def __init__(self) -> None:
        self.steps = 0
        self.stored = self.reserved = self.never = self.free = 0
        self.running = 0

    def add(self, stored: int, reserved: int, never: int, free: int, running: int) -> None:
        self.steps += 1
        self.stored += stored
        self.reserved += reserved
        self.never += never
        self.free += free
        self.running += running

    def ratios(self, kv_slots: float) -> dict[str, float]:
        r = self.reserved or 1
        return {
            "utilization": self.stored / r,
            "internal_never": self.never / r,
            "internal_pending": (self.reserved - self.stored - self.never) / r,
            "free": self.free / (kv_slots * self.steps) if self.steps else 0.0,
            "mean_running": self.running / self.steps if self.steps else 0.0,
        }


def replay(
    trace: LengthTrace,
    allocation: Allocation,
    max_model_len: int,
    *,
    shape: KVCacheShape = DEFAULT_SHAPE,
    kv_memory: int = DEFAULT_KV_MEMORY,
    repeat: int = 1,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int | None = None,
) -> ReplayResult:
    """Replay `trace` (`repeat` times over, all submitted at once) through our scheduler and pool."""
    unit = max_model_len if allocation.kind == "contiguous" else allocation.unit
    budget = plan_kv_cache(shape, unit, kv_memory)
    kv_slots = kv_memory / shape.bytes_per_token
    pool = BlockPool(budget.num_blocks)
    kv_cache = KVCacheManager(pool, unit, enable_prefix_caching=False)
    n_total = trace.num_requests * repeat
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs or n_total, max_num_batched_tokens=max_num_batched_tokens, watermark=0.0
    )
    scheduler = Scheduler(kv_cache, config, max_model_len)

    final: dict[str, int] = {}  # tokens whose KV a request will have written when it finishes
    refused = truncated = 0
    for i in range(n_total):
        prompt, output = (
            trace.prompt_tokens[i % trace.num_requests],
            trace.output_tokens[i % trace.num_requests],
        )
        # Token ids do not matter without prefix caching; the last sampled token's KV is never written.
        request = Request(
            f"r{i}", [0] * prompt, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
        )
        try:
            scheduler.add_request(request)
        except ValueError:
            refused += 1
            continue
        truncated += prompt + output > max_model_len
        final[request.request_id] = min(prompt + output, max_model_len) - 1

    window, every_step = _Totals(), _Totals()
    peak = output_tokens = computed = 0
    saturated = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        if out.is_empty:
            raise RuntimeError(f"{allocation.label}: the scheduler made no progress")
        computed += out.num_batched_tokens
        sampled = {s.request.request_id: 0 for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, sampled)
        output_tokens += len(sampled)
        stored = never = 0
        for r in scheduler.running:
            slots = len(r.block_table) * unit
            stored += r.num_computed_tokens
            never += max(0, slots - final[r.request_id])
        reserved = pool.num_used_blocks * unit
        free = pool.num_free_blocks * unit
        snapshot = (stored, reserved, never, free, scheduler.num_running)
        every_step.add(*snapshot)
        peak = max(peak, scheduler.num_running)
        if scheduler.num_waiting:
            saturated = True
            window.add(*snapshot)
    kv_cache.check_integrity()
    assert pool.num_used_blocks == 0, "blocks leaked after every request finished"

    w = window.ratios(kv_slots) if saturated else every_step.ratios(kv_slots)
    return ReplayResult(
        allocation=allocation.label,
        unit=unit,
        max_model_len=max_model_len,
        kv_slots=kv_slots,
        num_units=budget.num_blocks,
        requests=n_total,
        refused=refused,
        truncated=truncated,
        steps=every_step.steps,
        window_steps=window.steps if saturated else every_step.steps,
        saturated=saturated,
        preemptions=scheduler.num_preemptions,
        output_tokens=output_tokens,
        computed_tokens=computed,
        recomputed_tokens=computed - sum(final.values()),
        utilization=w["utilization"],
        internal_never=w["internal_never"],
        internal_pending=w["internal_pending"],
        external=1 - budget.num_tokens / kv_slots,
        free_while_waiting=w["free"] if saturated else 0.0,
        peak_running=peak,
        mean_running=w["mean_running"],
        whole_run=every_step.ratios(kv_slots),
    )


def sum_final(r: ReplayResult) -> int:
    """KV tokens the admitted requests write at least once: computed minus recomputed."""
    return r.computed_tokens - r.recomputed_tokens


def allocations(block_sizes: Sequence[int]) -> list[Allocation]:
    return [Allocation("contiguous", 0), *(Allocation("paged", b) for b in block_sizes)]


# -- the subcommand --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        nargs="+",
        default=list(WORKLOADS),
        help=f"shipped traces ({', '.join(WORKLOADS)}) or trace files (default: all three)",
    )
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--max-model-len", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--kv-memory", type=float, default=DEFAULT_KV_MEMORY / 2**30, help="KV memory, GiB")
    p.add_argument(
        "--kv-dtype",
        default="float32",
        choices=sorted(KV_DTYPE_BYTES),
        help="element type of the default model's KV (sets bytes per token)",
    )
    p.add_argument("--repeat", type=int, default=4, help="submit each trace this many times at once")
    p.add_argument(
        "--limit", type=int, default=None, help="use only the first N requests of each trace (default: all)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    if args.repeat < 1 or min(args.block_sizes) < 1 or min(args.max_model_len) < 2:
        raise ValueError("--repeat and --block-sizes must be >= 1, --max-model-len >= 2")
    shape = KVCacheShape(
        DEFAULT_SHAPE.num_layers,
        DEFAULT_SHAPE.num_kv_heads,
        DEFAULT_SHAPE.head_dim,
        KV_DTYPE_BYTES[args.kv_dtype],
    )
    kv_memory = int(args.kv_memory * 2**30)
    traces = [_limited(load_trace(w), args.limit) for w in args.workload]
    allocs = allocations(args.block_sizes)
    jobs = [(t, m, a) for t in traces for m in args.max_model_len for a in allocs]
    results: list[tuple[str, ReplayResult]] = []
    for trace, mml, alloc in report.progress(jobs, desc="replay"):
        res = replay(
            trace,
            alloc,
            mml,
            shape=shape,
            kv_memory=kv_memory,
            repeat=args.repeat,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        results.append((trace.workload, res))

    header = (
        "workload",
        "max_model_len",
        "allocation",
        "refused",
        "KV util",
        "internal frag (never+pending)",
        "external frag",
        "free while waiting",
        "peak / mean running",
        "preempt (recomputed)",
        "steps",
    )
    rows = [
        (
            wl,
            str(r.max_model_len),
            r.allocation,
            str(r.refused),
            fmt_pct(r.utilization) if r.requests > r.refused else "-",
            f"{fmt_pct(r.internal)} ({fmt_pct(r.internal_never)}+{fmt_pct(r.internal_pending)})",
            fmt_pct(r.external, 2),
            fmt_pct(r.free_while_waiting),
            f"{r.peak_running} / {r.mean_running:.1f}",
            f"{r.preemptions} ({fmt_pct(r.recomputed_tokens / max(1, sum_final(r)))})",
            str(r.steps),
        )
        for wl, r in results
    ]
    notes = [
        f"KV memory {args.kv_memory:g} GiB at {shape.bytes_per_token} B/token = {kv_memory / shape.bytes_per_token:,.0f} "
        f"token slots; each trace submitted {args.repeat}x at once; token budget {args.max_num_batched_tokens}/step",
        *(f"{t.workload}: {t.summary()}" for t in traces),
        f"PagedAttention paper: contiguous < {PAPER_CONTIGUOUS_UTILIZATION:.0%} utilization, "
        f"paged ~{PAPER_PAGED_UTILIZATION:.0%}",
    ]
    report.table("KV memory: contiguous pre-allocation vs our paged pool", header, rows, notes)
    _plot(report, results)
    return {
        "kv_memory_bytes": kv_memory,
        "bytes_per_token": shape.bytes_per_token,
        "repeat": args.repeat,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "traces": {
            t.workload: {"summary": t.summary(), "model": t.model, "requests": t.num_requests} for t in traces
        },
        "results": [{"workload": wl, **asdict(r), "internal": r.internal} for wl, r in results],
    }


def _limited(trace: LengthTrace, limit: int | None) -> LengthTrace:
    if limit is None or limit >= trace.num_requests:
        return trace
    return LengthTrace(
        trace.workload,
        trace.description,
        trace.model,
        trace.max_tokens,
        trace.prompt_tokens[:limit],
        trace.output_tokens[:limit],
        trace.finish_reasons[:limit],
        trace.command,
    )


def _plot(report: Report, results: list[tuple[str, ReplayResult]]) -> None:
    fig = report.figure(ncols=2, width=12, height=4.5)
    if fig is None:
        return
    workloads = list(dict.fromkeys(wl for wl, _ in results))
    labels = list(dict.fromkeys(f"{r.allocation}\nmax_model_len {r.max_model_len}" for _, r in results))
    ax_util, ax_conc = fig.axes
    width = 0.8 / max(1, len(workloads))
    for k, wl in enumerate(workloads):
        by_label = {f"{r.allocation}\nmax_model_len {r.max_model_len}": r for w, r in results if w == wl}
        xs = [i + k * width for i in range(len(labels))]
        ax_util.bar(
            xs, [100 * by_label[lb].utilization if lb in by_label else 0 for lb in labels], width, label=wl
        )
        ax_conc.bar(
            xs, [by_label[lb].mean_running if lb in by_label else 0 for lb in labels], width, label=wl
        )
    for ax, title in ((ax_util, "KV utilization (%)"), (ax_conc, "mean running requests (saturated)")):
        ax.set_xticks([i + width * (len(workloads) - 1) / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
        ax.legend(fontsize=7, loc="upper center", ncol=len(workloads))
    ax_util.axhline(100 * PAPER_CONTIGUOUS_UTILIZATION, color="grey", ls="--", lw=0.8)
    ax_util.axhline(100 * PAPER_PAGED_UTILIZATION, color="grey", ls=":", lw=0.8)
    report.save_figure(fig)
