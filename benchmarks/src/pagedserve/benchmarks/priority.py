"""`pagedserve bench priority`: a priority-0 request arriving at a KV pool full of priority-10 streams.

    pagedserve bench priority                     # the default model, swap then recompute
    pagedserve bench priority --modes recompute --streams 8

In one process, per preemption mode (`--modes`, default swap then recompute), on a fresh fp32
engine whose device pool holds exactly what `--streams` priority-10 greedy streams
(`--prompt-len` prompt tokens, `--max-tokens` generated, `ignore_eos`) need together:

1. the streams run alone to their end: the reference tokens;
2. the prefix cache is reset and the same streams start again; once the pool has fewer free
   blocks than the urgent request's prompt needs, a priority-0 request (`--urgent-prompt-len`
   tokens of its own, `--urgent-tokens` generated) is added. Its time to first token is timed
   in steps and in wall time from its submission; the decode step is the median of the 8
   steps before it arrived (the pool full, every stream decoding);
3. its prefill alone: the urgent prompt on the idle engine (prefix cache reset), one step
   timed, `--repeat` times (the median).

The issue's target: its TTFT within 2 decode steps + its own prefill, and the preempted
streams finish with the greedy tokens of their unpreempted run (both printed per mode).
Run it alone on the machine: on 2 cores another busy process skews every step.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import time
from typing import Any

from pagedserve.benchmarks.common import default_model, load_note, phase, warn_if_busy
from pagedserve.benchmarks.report import Report

MODES = ("swap", "recompute")
STREAM_PRIORITY = 10
URGENT_PRIORITY = 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=default_model(), help="model name or path (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="preemption modes to run, in order")
    ap.add_argument("--streams", type=int, default=6, help="priority-10 streams filling the pool")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each stream")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens each stream generates")
    ap.add_argument("--urgent-prompt-len", type=int, default=64, help="prompt tokens of the urgent request")
    ap.add_argument("--urgent-tokens", type=int, default=8, help="tokens the urgent request generates")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeat", type=int, default=3, help="timed prefills of the urgent prompt alone")
    ap.add_argument("--seed", type=int, default=0, help="prompt token seed")


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    hi = max(2, vocab) - 1
    streams = [[rng.randint(1, hi) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    return streams, [rng.randint(1, hi) for _ in range(args.urgent_prompt_len)]


def _add(engine: Any, prompt: list[int], max_tokens: int, rid: str, priority: int) -> Any:
    from pagedserve.dataplane import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params, request_id=rid)
    for sample in engine.samples_of(rid):  # (as the data plane's server sets a submit's priority)
        sample.priority = priority
    return request


def _drain(engine: Any, requests: list[Any]) -> list[list[int]]:
    while engine.has_unfinished_requests():
        engine.step()
    outputs = [list(r.output_token_ids) for r in requests]
    for r in requests:
        engine.release(r.request_id)
    return outputs


def run_mode(args: argparse.Namespace, model: str, mode: str) -> dict[str, Any]:
    from pagedserve.dataplane import LLM

    per_stream = -(-(args.prompt_len + args.max_tokens) // args.block_size)
    llm = LLM(
        model,
        dtype="float32",
        block_size=args.block_size,
        num_gpu_blocks_override=args.streams * per_stream,
        max_num_seqs=args.streams + 1,
        num_threads=args.threads,
        preemption_mode=mode,
    )
    engine = llm.engine
    vocab = int(engine.runner.model.config.vocab_size)
    streams, urgent_prompt = _prompts(args, vocab)
    urgent_blocks = -(-args.urgent_prompt_len // args.block_size)

    # 1. The reference: the streams alone.
    alone = [_add(engine, p, args.max_tokens, f"ref{i}", STREAM_PRIORITY) for i, p in enumerate(streams)]
    reference = _drain(engine, alone)

    # 2. The streams again, the urgent request once the pool is full.
    llm.reset_prefix_cache()
    before = engine.stats()
    running = [_add(engine, p, args.max_tokens, f"s{i}", STREAM_PRIORITY) for i, p in enumerate(streams)]
    steps: list[float] = []
    while engine.pool.num_free_blocks >= urgent_blocks:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if not engine.has_unfinished_requests():
            raise SystemExit("the streams finished before the pool was full: raise --max-tokens")
    decode_s = statistics.median(steps[-8:])
    free_at_arrival = engine.pool.num_free_blocks
    submitted = time.perf_counter()
    urgent = _add(engine, urgent_prompt, args.urgent_tokens, "urgent", URGENT_PRIORITY)
    ttft_steps = 0
    while urgent.num_output_tokens == 0:
        engine.step()
        ttft_steps += 1
    ttft_s = time.perf_counter() - submitted
    outputs = _drain(engine, [*running, urgent])
    after = engine.stats()
    engine_priority_preemptions = engine.scheduler.num_priority_preemptions
    engine.check_integrity()

    # 3. The urgent prompt's prefill alone, on the idle engine.
    prefills = []
    for k in range(args.repeat):
        llm.reset_prefix_cache()
        alone_urgent = _add(engine, urgent_prompt, 1, f"alone{k}", URGENT_PRIORITY)
        t = time.perf_counter()
        engine.step()
        prefills.append(time.perf_counter() - t)
        _drain(engine, [alone_urgent])
    prefill_s = statistics.median(prefills)
    free = engine.pool.num_free_blocks == engine.pool.num_blocks
    del llm, engine
    gc.collect()
    same = sum(a == b for a, b in zip(outputs[:-1], reference, strict=True))
    return {
        "mode": mode,
        "pool_blocks": args.streams * per_stream,
        "free_blocks_at_arrival": free_at_arrival,
        "decode_step_ms": 1000 * decode_s,
        "urgent_prefill_ms": 1000 * prefill_s,
        "urgent_ttft_ms": 1000 * ttft_s,
        "urgent_ttft_steps": ttft_steps,
        "target_ms": 1000 * (2 * decode_s + prefill_s),
        "within_target": ttft_s <= 2 * decode_s + prefill_s,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "priority_preemptions": engine_priority_preemptions,
        "streams_same_greedy_tokens": same,
        "streams": len(reference),
        "pool_free_after": free,
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: choose from {','.join(MODES)}, got {args.modes!r}")
    loads = load_note()
    warn_if_busy(loads)
    from pagedserve.common.models import resolve_model_path

    model = str(resolve_model_path(args.model))
    runs = [phase(f"mode {m}", functools.partial(run_mode, args, model, m)) for m in modes]
    rows = [
        [
            r["mode"],
            f"{r['decode_step_ms']:.1f}",
            f"{r['urgent_prefill_ms']:.1f}",
            f"{r['urgent_ttft_ms']:.1f} ({r['urgent_ttft_steps']} step{'s' if r['urgent_ttft_steps'] != 1 else ''})",
            f"{r['target_ms']:.1f}",
            str(r["priority_preemptions"]),
            f"{r['streams_same_greedy_tokens']}/{r['streams']}",
        ]
        for r in runs
    ]
    report.table(
        f"priority: a priority-0 request on a pool full of {args.streams} priority-{STREAM_PRIORITY} streams",
        [
            "mode",
            "decode step ms",
            "its prefill alone ms",
            "its TTFT ms",
            "2 steps + prefill ms",
            "preempted",
            "streams' tokens as unpreempted",
        ],
        rows,
        [
            f"{r['mode']}: TTFT {'within' if r['within_target'] else 'OVER'} 2 decode steps + its own prefill"
            for r in runs
        ],
    )
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
        "loadavg": loads,
        "modes": runs,
    }
