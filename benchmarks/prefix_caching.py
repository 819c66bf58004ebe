"""Prefix caching on a multi-turn customer-service chat workload: caching ON vs OFF, one run.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench prefix-caching                   # = python -m pagedserve.benchmarks.prefix_caching

Quick plumbing check (a minute or less, numbers meaningless):

    pagedserve bench prefix-caching --conversations 4 --concurrency 2 --max-tokens 8

What it does, in one process and strictly one phase after another:

1. Workload (`pagedserve.benchmarks.workloads.customer_service_dialogues`): `--conversations` chats
   (default 32, 127 turns in all) that all share one ~620-token system prompt (an online
   shop's assistant: tone, catalogue, shipping/refund/account policies), 3-5 customer turns
   each. Turn k's prompt is the model's chat template over [system, user 1, assistant 1, ...,
   user k] where assistant i is the reply the model actually gave at turn i (decoded text), so
   prompts grow turn by turn and every turn's prompt extends the previous turn's.
2. For caching ON, then OFF (`--runs`): a fresh `LLM(..., enable_prefix_caching=...)` (built,
   not timed), warmed up with 4 unrelated chat prompts of 64-700 tokens (8 tokens each), prefix
   cache then reset and its counters snapshotted. THE measured run is a closed loop driving
   `llm.engine` directly: `--concurrency` conversations are active at once (default 16); a
   conversation submits its next turn (`add_request`, arrival = now) as soon as its previous
   turn finishes, in the same loop iteration, and when a conversation ends the next one starts.
   `step()` runs until every turn of every conversation is done. Replies are greedy with
   exactly `--max-tokens` tokens (default 64; `ignore_eos=True`, so both runs do identical
   work); the reply text fed back into the history is the output up to its first end-of-turn
   token (what a client that stops at EOS would have shown), decoded without special tokens.
3. Per run: TTFT per turn (`first_token_time - arrival_time`: queueing + prefill + first
   sample), its p50/p90/mean, overall, over turns 2+ (past each conversation's cold first turn)
   and by turn number; end-to-end throughput (output tok/s,
   turns/s over the wall time from the first submission to the last finish); mean prompt
   tokens; prefix-cache hit rate (`kv_cache.prefix_cache_stats`: hit tokens / queried tokens at
   first admission, warm-up excluded) next to the block-aligned reusable prefix (an upper bound:
   the longest prefix each prompt shares with its conversation's previous turn, prompt + output,
   or with the shared system prompt); prompt tokens actually computed; preemptions; engine
   steps, mean step time and mean steps from a turn's arrival to its first token.
4. ON vs OFF: TTFT reduction (1 - ON/OFF) at p50 and p90 and the output-throughput ratio
   ON/OFF, against a common claim for prefix caching with a shared system prompt (TTFT -60%,
   throughput >= 3x; cf. SGLang's RadixAttention, Zheng et al., arXiv:2312.07104; our goal is
   to beat both), and greedy agreement: every turn's prompt and output tokens compared ON vs
   OFF (fp32 greedy: they should be identical, which also keeps both runs on one workload).

`benchmarks/results/prefix-caching.json` holds everything, per-turn records included; the PNG
shows the TTFT distribution of both runs.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.benchmarks.common import default_model, engine_from_args, load_note, phase, warn_if_busy
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.workloads import Dialogue, chat_prompts, customer_service_dialogues
from pagedserve.common.settings import parse_bytes

# A common claim for prefix caching with a shared system prompt: TTFT -60% and >= 3x throughput
# with caching on (SGLang's RadixAttention paper, Zheng et al., arXiv:2312.07104, measures gains of
# this order from reusing shared prefixes).
CLAIMED_TTFT_REDUCTION = 0.60
CLAIMED_THROUGHPUT_RATIO = 3.0


# -- helpers -----------------------------------------------------------------------------------
def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template over `messages`, ending with the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant: "
    ids: list[int] = tokenizer.encode(text, add_special_tokens=True)
    return ids


def system_prompt_tokens(tokenizer: Any, system: str) -> int:
    """Tokens of the system message alone, chat-template frame included."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], tokenize=True, return_dict=True
        )
        return len(out["input_ids"])
    return len(tokenizer.encode(f"system: {system}\n\n", add_special_tokens=True))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- one run -----------------------------------------------------------------------------------
@dataclass
class TurnRecord:
    conversation: str
    turn: int  # 1-based
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int  # block-aligned upper bound on cacheable prefix (filled after the run)
    output_token_ids: list[int]
    reply_tokens: int  # output tokens before the first end-of-turn token (fed back as history)
    arrival_s: float  # since the start of the measured run
    ttft_s: float
    latency_s: float
    num_preemptions: int
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class DialogueRun:
    label: str  # "on" | "off"
    enable_prefix_caching: bool
    load_seconds: float
    warmup_seconds: float
    wall_seconds: float
    client_seconds: float  # templating + tokenizing + decoding replies inside the measured loop
    steps: int
    step_log: list[tuple[float, float, int, int]]  # (start since run start, seconds, batched tokens, sampled)
    batched_tokens: int
    preempted: int  # sum of StepResult.num_preempted
    prefix_stats: dict[str, int]  # counter deltas over the measured run
    turns: list[TurnRecord]
    num_blocks: int


def _reply_end(output: Sequence[int], stop_ids: set[int]) -> int:
    return next((i for i, t in enumerate(output) if t in stop_ids), len(output))


def run_dialogues(
    args: argparse.Namespace, model: str, dialogues: list[Dialogue], caching: bool
) -> DialogueRun:
    from pagedserve.dataplane import SamplingParams

    t = time.perf_counter()
    llm = engine_from_args(args, model, enable_prefix_caching=caching)
    load_s = time.perf_counter() - t
    engine = llm.engine
    tok: Any = engine.tokenizer
    if tok is None:
        raise RuntimeError(f"{model} has no tokenizer: the dialogue workload needs one")

    # Warm-up on unrelated prompts (another system prompt), then forget what they cached.
    t = time.perf_counter()
    warm_prompts = chat_prompts(tok, 4, 64, 700, seed=1)
    warm = llm.generate(
        warm_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    if any(len(o.token_ids) != 8 for o in warm):
        raise RuntimeError(f"warm-up produced lengths {[len(o.token_ids) for o in warm]}, expected 8")
    llm.reset_prefix_cache()
    warm_s = time.perf_counter() - t
    stats0 = dataclasses.replace(engine.kv_cache.prefix_cache_stats)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    stop_ids = set(getattr(engine, "eos_token_ids", ()) or ())
    if getattr(tok, "eos_token_id", None) is not None:
        stop_ids.add(int(tok.eos_token_id))

    replies: list[list[str]] = [[] for _ in dialogues]
    inflight: dict[str, tuple[int, list[int]]] = {}
    records: list[TurnRecord] = []
    client_s = 0.0
    steps = batched = preempted = idle = 0
    step_log: list[tuple[float, float, int, int]] = []
    next_conv = 0

    t0 = time.monotonic()

    def submit(ci: int) -> None:
        nonlocal client_s
        c = time.perf_counter()
        d = dialogues[ci]
        ids = encode_chat(tok, d.messages(replies[ci]))
        client_s += time.perf_counter() - c
        rid = f"{d.conversation_id}-t{len(replies[ci]) + 1}"
        engine.add_request(ids, params, request_id=rid)
        inflight[rid] = (ci, ids)

    while next_conv < min(args.concurrency, len(dialogues)):
        submit(next_conv)
        next_conv += 1
    while engine.has_unfinished_requests():
        s0 = time.monotonic()
        result = engine.step()
        step_log.append((s0 - t0, time.monotonic() - s0, result.num_batched_tokens, len(result.new_tokens)))
        steps += 1
        batched += result.num_batched_tokens
        preempted += result.num_preempted
        idle = idle + 1 if result.num_batched_tokens == 0 and not result.finished else 0
        if idle > 100:
            raise RuntimeError("engine.step() made no progress for 100 steps with requests pending")
        for r in result.finished:
            ci, ids = inflight.pop(r.request_id)
            d = dialogues[ci]
            out = list(r.output_token_ids)
            if len(out) != args.max_tokens:
                raise RuntimeError(f"{r.request_id}: {len(out)} output tokens, expected {args.max_tokens}")
            if r.first_token_time is None or r.finish_time is None:
                raise RuntimeError(f"{r.request_id}: finished without first-token/finish times")
            c = time.perf_counter()
            end = _reply_end(out, stop_ids)
            reply = str(tok.decode(out[:end], skip_special_tokens=True)).strip()
            client_s += time.perf_counter() - c
            records.append(
                TurnRecord(
                    conversation=d.conversation_id,
                    turn=len(replies[ci]) + 1,
                    request_id=r.request_id,
                    prompt_tokens=r.num_prompt_tokens,
                    cached_tokens=r.num_cached_tokens,
                    reusable_tokens=0,
                    output_token_ids=out,
                    reply_tokens=end,
                    arrival_s=r.arrival_time - t0,
                    ttft_s=r.first_token_time - r.arrival_time,
                    latency_s=r.finish_time - r.arrival_time,
                    num_preemptions=int(getattr(r, "num_preemptions", 0)),
                    prompt_token_ids=ids,
                )
            )
            engine.release(r.request_id)
            replies[ci].append(reply)
            if len(replies[ci]) < d.num_turns:
                submit(ci)
            elif next_conv < len(dialogues):
                submit(next_conv)
                next_conv += 1
    wall_s = time.monotonic() - t0
    if inflight or next_conv < len(dialogues):
        raise RuntimeError(
            f"run ended with {len(inflight)} turns in flight, {next_conv} conversations started"
        )

    s1 = engine.kv_cache.prefix_cache_stats
    deltas = {f.name: getattr(s1, f.name) - getattr(stats0, f.name) for f in dataclasses.fields(s1)}
    num_blocks = int(engine.budget.num_blocks)
    _fill_reusable(records, args.block_size)
    return DialogueRun(
        label="on" if caching else "off",
        enable_prefix_caching=caching,
        load_seconds=load_s,
        warmup_seconds=warm_s,
        wall_seconds=wall_s,
        client_seconds=client_s,
        steps=steps,
        step_log=step_log,
        batched_tokens=batched,
        preempted=preempted,
        prefix_stats=deltas,
        turns=records,
        num_blocks=num_blocks,
    )


def _fill_reusable(records: list[TurnRecord], block_size: int) -> None:
    """Upper bound on cacheable tokens per turn: the longest prefix shared with the same
    conversation's previous turn (prompt + output) or with the first prompt submitted (the
    system prompt), in whole blocks, leaving at least one prompt token to compute."""
    if not records:
        return
    first = min(records, key=lambda r: r.arrival_s).prompt_token_ids
    prev: dict[tuple[str, int], list[int]] = {
        (r.conversation, r.turn): r.prompt_token_ids + r.output_token_ids for r in records
    }
    for r in records:
        ids = r.prompt_token_ids
        best = 0 if ids is first else common_prefix(ids, first)
        before = prev.get((r.conversation, r.turn - 1))
        if before is not None:
            best = max(best, common_prefix(ids, before))
        best = min(best, len(ids) - 1)
        r.reusable_tokens = best // block_size * block_size


# -- report ------------------------------------------------------------------------------------
def summarize(run: DialogueRun) -> dict[str, Any]:
    turns = run.turns
    ttft = [r.ttft_s for r in turns]
    later = [r.ttft_s for r in turns if r.turn >= 2]  # past each conversation's cold first turn
    out_tokens = sum(len(r.output_token_ids) for r in turns)
    prompt = sum(r.prompt_tokens for r in turns)
    cached = sum(r.cached_tokens for r in turns)
    st = run.prefix_stats
    by_turn: dict[int, dict[str, Any]] = {}
    for k in sorted({r.turn for r in turns}):
        rs = [r for r in turns if r.turn == k]
        by_turn[k] = {
            "turns": len(rs),
            "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
            "mean_cached_tokens": statistics.fmean(r.cached_tokens for r in rs),
            "ttft_p50_s": percentile([r.ttft_s for r in rs], 50),
            "ttft_p90_s": percentile([r.ttft_s for r in rs], 90),
        }
    return {
        "enable_prefix_caching": run.enable_prefix_caching,
        "load_seconds": run.load_seconds,
        "warmup_seconds": run.warmup_seconds,
        "wall_seconds": run.wall_seconds,
        "client_seconds": run.client_seconds,
        "turns": len(turns),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / run.wall_seconds,
        "turns_per_s": len(turns) / run.wall_seconds,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_turn2plus_s": percentile(later, 50),
        "ttft_p90_turn2plus_s": percentile(later, 90),
        "latency_p50_s": percentile([r.latency_s for r in turns], 50),
        "prompt_tokens": prompt,
        "mean_prompt_tokens": prompt / len(turns),
        "cached_tokens": cached,
        "reusable_tokens": sum(r.reusable_tokens for r in turns),
        "prompt_tokens_computed": prompt - cached,
        "hit_rate": st["hits"] / st["queries"] if st.get("queries") else 0.0,
        "reusable_rate": sum(r.reusable_tokens for r in turns) / prompt,
        "prefix_cache_stats": st,
        "steps": run.steps,
        "mean_step_ms": 1e3 * statistics.fmean(s[1] for s in run.step_log) if run.step_log else 0.0,
        "mean_steps_to_first_token": _mean_steps_to_first_token(run),
        "batched_tokens": run.batched_tokens,
        "preempted": run.preempted,
        "num_blocks": run.num_blocks,
        "mean_reply_tokens_before_eos": statistics.fmean(r.reply_tokens for r in turns),
        "by_turn": by_turn,
    }


def _mean_steps_to_first_token(run: DialogueRun) -> float:
    """Mean number of steps that started at or after each turn's arrival up to its first token."""
    starts = [s[0] for s in run.step_log]
    if not starts or not run.turns:
        return 0.0
    counts = [
        bisect.bisect_right(starts, r.arrival_s + r.ttft_s) - bisect.bisect_left(starts, r.arrival_s)
        for r in run.turns
    ]
    return statistics.fmean(counts)


def agreement(a: DialogueRun, b: DialogueRun) -> dict[str, Any]:
    bs = {r.request_id: r for r in b.turns}
    same_prompt = same_output = matched = total = 0
    diverged: list[tuple[str, int]] = []
    missing = 0
    for r in a.turns:
        o = bs.get(r.request_id)
        if o is None:
            missing += 1
            continue
        same_prompt += r.prompt_token_ids == o.prompt_token_ids
        n = common_prefix(r.output_token_ids, o.output_token_ids)
        matched += n
        total += len(r.output_token_ids)
        if r.output_token_ids == o.output_token_ids:
            same_output += 1
        else:
            diverged.append((r.request_id, n))
    return {
        "turns": len(a.turns),
        "missing": missing,
        "identical_prompts": same_prompt,
        "identical_outputs": same_output,
        "tokens_before_first_divergence": matched,
        "tokens": total,
        "diverged": sorted(diverged),
    }


def build_report(
    args: argparse.Namespace,
    model_path: Path,
    dialogues: list[Dialogue],
    system_tokens: int,
    runs: dict[str, DialogueRun],
    loads: dict[str, tuple[float, ...]],
) -> dict[str, Any]:
    import torch

    rep: dict[str, Any] = {
        "loadavg": loads,
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
        "model": str(model_path),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
        "workload": {
            "name": "customer_service_dialogues",
            "conversations": len(dialogues),
            "turns": sum(d.num_turns for d in dialogues),
            "turns_per_conversation": [d.num_turns for d in dialogues],
            "topics": [d.topic for d in dialogues],
            "system_prompt_tokens": system_tokens,
        },
        "runs": {k: summarize(v) for k, v in runs.items()},
    }
    goals: dict[str, Any] = {
        "claimed_ttft_reduction": CLAIMED_TTFT_REDUCTION,
        "claimed_throughput_ratio": CLAIMED_THROUGHPUT_RATIO,
    }
    if "on" in runs and "off" in runs:
        on, off = rep["runs"]["on"], rep["runs"]["off"]
        cmp = {
            "ttft_p50_reduction": 1 - on["ttft_p50_s"] / off["ttft_p50_s"],
            "ttft_p90_reduction": 1 - on["ttft_p90_s"] / off["ttft_p90_s"],
            "ttft_mean_reduction": 1 - on["ttft_mean_s"] / off["ttft_mean_s"],
            "ttft_p50_turn2plus_reduction": 1 - on["ttft_p50_turn2plus_s"] / off["ttft_p50_turn2plus_s"],
            "ttft_p90_turn2plus_reduction": 1 - on["ttft_p90_turn2plus_s"] / off["ttft_p90_turn2plus_s"],
            "output_throughput_ratio": on["output_tok_s"] / off["output_tok_s"],
            "turns_per_s_ratio": on["turns_per_s"] / off["turns_per_s"],
        }
        rep["on_vs_off"] = cmp
        goals["ttft_p50_beats_claim"] = cmp["ttft_p50_reduction"] > CLAIMED_TTFT_REDUCTION
        goals["ttft_p90_beats_claim"] = cmp["ttft_p90_reduction"] > CLAIMED_TTFT_REDUCTION
        goals["throughput_beats_claim"] = cmp["output_throughput_ratio"] > CLAIMED_THROUGHPUT_RATIO
        rep["greedy_agreement"] = agreement(runs["on"], runs["off"])
    rep["goals"] = goals
    rep["turn_records"] = {
        k: [{f: v for f, v in asdict(r).items() if f != "prompt_token_ids"} for r in run.turns]
        for k, run in runs.items()
    }
    rep["steps_columns"] = ["start_s", "seconds", "num_batched_tokens", "num_sampled"]
    rep["steps"] = {k: [[round(x, 6) for x in st] for st in run.step_log] for k, run in runs.items()}
    return rep


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("BEATS the claim" if ok else "does NOT beat the claim")


def print_report(rep: dict[str, Any]) -> None:
    w, runs = rep["workload"], rep["runs"]
    print()
    print(
        f"== prefix caching: customer-service dialogues, {Path(rep['model']).name}, fp32, "
        f"{rep['torch']['threads']} torch threads =="
    )
    print(
        f"workload: {w['conversations']} conversations, {w['turns']} turns (3-5 each), one shared system "
        f"prompt of {w['system_prompt_tokens']} tokens; concurrency {rep['args']['concurrency']} (closed loop); "
        f"{rep['sampling']['max_tokens']} output tokens per turn (greedy, ignore_eos)"
    )
    print(f"load average at start/end: {rep['loadavg']}")
    print()
    cols = [k for k in ("on", "off") if k in runs]
    head = {"on": "caching ON", "off": "caching OFF"}
    print(f"{'':32}" + "".join(f"{head[c]:>14}" for c in cols))

    def row(label: str, key: str, fmt: str, scale: float = 1) -> None:
        print(f"{label:32}" + "".join(f"{format(runs[c][key] * scale, fmt):>14}" for c in cols))

    row("TTFT p50 (ms)", "ttft_p50_s", ".1f", 1e3)
    row("TTFT p90 (ms)", "ttft_p90_s", ".1f", 1e3)
    row("TTFT mean (ms)", "ttft_mean_s", ".1f", 1e3)
    row("TTFT p50, turns 2+ (ms)", "ttft_p50_turn2plus_s", ".1f", 1e3)
    row("TTFT p90, turns 2+ (ms)", "ttft_p90_turn2plus_s", ".1f", 1e3)
    row("latency p50 (ms)", "latency_p50_s", ".1f", 1e3)
    row("output tok/s", "output_tok_s", ".1f")
    row("turns/s", "turns_per_s", ".3f")
    row("wall time (s)", "wall_seconds", ".2f")
    row("mean prompt tokens", "mean_prompt_tokens", ".1f")
    row("prefix hit rate (%)", "hit_rate", ".1f", 100)
    row("reusable prefix, upper bd (%)", "reusable_rate", ".1f", 100)
    row("prompt tokens computed", "prompt_tokens_computed", "d")
    row("engine steps", "steps", "d")
    row("mean step time (ms)", "mean_step_ms", ".1f")
    row("mean steps to first token", "mean_steps_to_first_token", ".2f")
    row("preempted", "preempted", "d")
    row("client-side time (s)", "client_seconds", ".2f")
    print()
    print("TTFT p50 by turn (ms):")
    turns = sorted({int(k) for c in cols for k in runs[c]["by_turn"]})
    print(f"{'  turn':10}{'turns':>7}{'prompt tok':>12}" + "".join(f"{head[c]:>14}" for c in cols))
    for k in turns:
        first = runs[cols[0]]["by_turn"][k]
        print(
            f"{'  ' + str(k):10}{first['turns']:>7}{first['mean_prompt_tokens']:>12.1f}"
            + "".join(f"{1e3 * runs[c]['by_turn'][k]['ttft_p50_s']:>14.1f}" for c in cols)
        )
    cmp, goals = rep.get("on_vs_off"), rep["goals"]
    if cmp:
        print()
        claim_r, claim_x = 100 * CLAIMED_TTFT_REDUCTION, CLAIMED_THROUGHPUT_RATIO
        print(
            f"TTFT p50 reduction ON vs OFF: {100 * cmp['ttft_p50_reduction']:6.1f}%   "
            f"claimed -{claim_r:.0f}%: {_verdict(goals.get('ttft_p50_beats_claim'))}"
        )
        print(
            f"TTFT p90 reduction ON vs OFF: {100 * cmp['ttft_p90_reduction']:6.1f}%   "
            f"claimed -{claim_r:.0f}%: {_verdict(goals.get('ttft_p90_beats_claim'))}"
        )
        print(
            f"  turns 2+ only (past the cold first turn): p50 {100 * cmp['ttft_p50_turn2plus_reduction']:.1f}%, "
            f"p90 {100 * cmp['ttft_p90_turn2plus_reduction']:.1f}%"
        )
        print(
            f"output throughput ON / OFF:   {cmp['output_throughput_ratio']:6.2f}x   "
            f"claimed >= {claim_x:.0f}x: {_verdict(goals.get('throughput_beats_claim'))}"
        )
    agree = rep.get("greedy_agreement")
    if agree:
        print()
        print(
            f"greedy agreement ON vs OFF: {agree['identical_outputs']}/{agree['turns']} turns with identical "
            f"outputs, {agree['identical_prompts']}/{agree['turns']} identical prompts, "
            f"{agree['tokens_before_first_divergence']}/{agree['tokens']} tokens before the first divergence"
            + (f"; diverged: {agree['diverged'][:8]}" if agree["diverged"] else "")
        )
    print()


# -- the subcommand ------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model", default=default_model(), help="store name or local HF folder (default: %(default)s)"
    )
    ap.add_argument("--conversations", type=int, default=32, help="number of conversations")
    ap.add_argument("--concurrency", type=int, default=16, help="conversations active at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per turn (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--runs", default="on,off", help="which runs, in order: on,off | off,on | on | off")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-memory", type=parse_bytes, default="2GiB", help="engine KV pool size (as `serve`)"
    )


def validate(args: argparse.Namespace) -> None:
    runs = (
        args.runs if isinstance(args.runs, list) else [r.strip() for r in args.runs.split(",") if r.strip()]
    )
    if not runs or any(r not in ("on", "off") for r in runs) or len(set(runs)) != len(runs):
        raise ValueError("--runs must list 'on' and/or 'off' once each, e.g. on,off")
    args.runs = runs
    if min(args.conversations, args.concurrency, args.max_tokens, args.threads) < 1:
        raise ValueError("--conversations, --concurrency, --max-tokens and --threads must be >= 1")


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    validate(args)
    import torch
    from transformers import AutoTokenizer

    from pagedserve.common.models import resolve_model_path

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    loads = {"start": report.loads["start"]}
    warn_if_busy(loads["start"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    dialogues = customer_service_dialogues(args.conversations, args.seed)
    system_tokens = system_prompt_tokens(tokenizer, dialogues[0].system)
    print(
        f"workload: {len(dialogues)} conversations, {sum(d.num_turns for d in dialogues)} turns, "
        f"system prompt {system_tokens} tokens",
        file=sys.stderr,
    )

    runs: dict[str, DialogueRun] = {}
    for label in report.progress(args.runs, desc="runs"):
        caching = label == "on"
        runs[label] = phase(
            f"caching {label.upper()}",
            functools.partial(run_dialogues, args, str(model_path), dialogues, caching),
        )
        gc.collect()  # drop the run's engine (model, KV cache) before the next one is built
        loads[f"after_{label}"] = load_note()
    loads["end"] = load_note()

    rep = build_report(args, model_path, dialogues, system_tokens, runs, loads)
    cols = [c for c in ("on", "off") if c in rep["runs"]]
    metrics = [
        ("TTFT p50 (ms)", "ttft_p50_s", 1e3, ".0f"),
        ("TTFT p90 (ms)", "ttft_p90_s", 1e3, ".0f"),
        ("TTFT p50, turns 2+ (ms)", "ttft_p50_turn2plus_s", 1e3, ".0f"),
        ("output tok/s", "output_tok_s", 1, ".1f"),
        ("prefix hit rate (%)", "hit_rate", 100, ".1f"),
        ("prompt tokens computed", "prompt_tokens_computed", 1, ",.0f"),
    ]
    report.table(
        "Prefix caching on vs off (customer-service dialogues)",
        ["", *(f"caching {c.upper()}" for c in cols)],
        [[label, *(format(rep["runs"][c][key] * k, f) for c in cols)] for label, key, k, f in metrics],
        [
            f"{len(dialogues)} conversations, concurrency {args.concurrency}, {args.max_tokens} tokens per reply"
        ],
    )
    print_report(rep)
    _plot(report, rep)
    return rep


def _plot(report: Report, rep: dict[str, Any]) -> None:
    fig = report.figure(width=7, height=4.5)
    if fig is None:
        return
    ax = fig.axes[0]
    for label, records in rep["turn_records"].items():
        ttft = sorted(1e3 * r["ttft_s"] for r in records)
        ax.step(
            ttft,
            [(i + 1) / len(ttft) for i in range(len(ttft))],
            where="post",
            label=f"caching {label.upper()}",
        )
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of turns")
    ax.set_title("TTFT distribution", fontsize=9)
    ax.legend(fontsize=8)
    report.save_figure(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedserve.benchmarks.prefix_caching ...` = `pagedserve bench prefix-caching ...`."""
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["prefix-caching", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
