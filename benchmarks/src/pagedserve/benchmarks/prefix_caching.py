"""Prefix caching on a multi-turn customer-service chat workload: caching ON vs OFF, one run.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench prefix-caching                   # = python -m pagedserve.benchmarks.prefix_caching

Quick plumbing check (a minute or less, numbers meaningless):

    pagedserve bench prefix-caching --conversations 4 --concurrency 2 --max-tokens 8

What it does, in one process and strictly one phase after another:

1. Workload (`pagedserve.benchmarks.dialogues.customer_service_dialogues`): `--conversations` chats
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
import functools
import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.common import default_model, load_note, phase, warn_if_busy
from pagedserve.benchmarks.dialogues import customer_service_dialogues
from pagedserve.benchmarks.prefix_caching_report import _plot, build_report, print_report
from pagedserve.benchmarks.prefix_caching_run import DialogueRun, run_dialogues, system_prompt_tokens
from pagedserve.benchmarks.report import Report
from pagedserve.common.settings import parse_bytes


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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedserve.benchmarks.prefix_caching ...` = `pagedserve bench prefix-caching ...`."""
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["prefix-caching", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
