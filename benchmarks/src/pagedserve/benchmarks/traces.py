"""Length traces: each workload's real prompt and output lengths, recorded once and shipped.

`pagedserve bench memory` replays these without a model (and without torch): what matters
to KV memory is how many tokens each request holds, not which. A trace is recorded by
running the workload through our engine with the default model, greedy, stopping at the
model's end-of-turn token (or at `max_tokens`), so the output lengths are the ones the model
really produces, not a distribution we picked:

    pagedserve bench trace --workload chat              # or customer-service, long-context, all

Shipped traces (`benchmarks/src/pagedserve/benchmarks/data/traces/*.json`, SmolLM2-135M-Instruct, its chat template):

- `chat`: the 64 prompts of `workloads.chat_prompts` (20-300 tokens), up to 1024 new tokens.
- `customer-service`: every turn of the 32 `customer_service_dialogues` (127 requests), turn k's
  prompt holding the system prompt and the model's own replies to turns 1..k-1; up to 256 new
  tokens per reply. Requests are listed conversation by conversation, turn by turn.
- `long-context`: the 16 prompts of `workloads.long_context_prompts` (2,048-3,840 tokens), up to
  256 new tokens.

A trace file is JSON: `{"workload", "description", "model", "max_tokens", "command",
"columns": ["prompt_tokens", "output_tokens", "finish_reason"], "rows": [[...], ...]}`; users
can write their own from production logs and pass it with `--trace PATH`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.workloads import DATA_DIR

TRACE_DIR = DATA_DIR / "traces"
TRACE_COLUMNS = ("prompt_tokens", "output_tokens", "finish_reason")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    max_tokens: int  # cap on new tokens when recording


WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec("chat", "64 single-turn chat prompts of 20-300 tokens (workloads.chat_prompts)", 1024),
        WorkloadSpec(
            "customer-service",
            "32 customer-service conversations, 127 turns, one shared 620-token system prompt "
            "(dialogues.customer_service_dialogues)",
            256,
        ),
        WorkloadSpec(
            "long-context",
            "16 prompts of 2,048-3,840 tokens: background reading plus a question about it "
            "(workloads.long_context_prompts)",
            256,
        ),
    )
}


@dataclass(frozen=True)
class LengthTrace:
    """Per request, in submission order: prompt tokens, output tokens and why it stopped."""

    workload: str
    description: str
    model: str
    max_tokens: int
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    finish_reasons: tuple[str, ...]
    command: str = ""

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        if not n or len(self.output_tokens) != n or len(self.finish_reasons) != n:
            raise ValueError(f"trace {self.workload!r}: columns must be non-empty and of equal length")
        if min(self.prompt_tokens) < 1 or min(self.output_tokens) < 1:
            raise ValueError(f"trace {self.workload!r}: every request needs >= 1 prompt and output token")

    @property
    def num_requests(self) -> int:
        return len(self.prompt_tokens)

    def total_tokens(self) -> list[int]:
        return [p + o for p, o in zip(self.prompt_tokens, self.output_tokens, strict=True)]

    def summary(self) -> str:
        p, o = self.prompt_tokens, self.output_tokens
        stopped = sum(r == "stop" for r in self.finish_reasons)
        return (
            f"{self.num_requests} requests; prompt tokens {min(p)}-{max(p)} (mean {sum(p) / len(p):.0f}); "
            f"output tokens {min(o)}-{max(o)} (mean {sum(o) / len(o):.0f}); "
            f"{stopped} stopped at EOS, {self.num_requests - stopped} at max_tokens={self.max_tokens}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "description": self.description,
            "model": self.model,
            "max_tokens": self.max_tokens,
            "command": self.command,
            "columns": list(TRACE_COLUMNS),
            "rows": [
                list(r) for r in zip(self.prompt_tokens, self.output_tokens, self.finish_reasons, strict=True)
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LengthTrace:
        if tuple(data.get("columns", ())) != TRACE_COLUMNS:
            raise ValueError(f"a trace needs columns {list(TRACE_COLUMNS)}, got {data.get('columns')}")
        rows = data["rows"]
        return cls(
            workload=str(data["workload"]),
            description=str(data.get("description", "")),
            model=str(data.get("model", "")),
            max_tokens=int(data.get("max_tokens", 0)),
            prompt_tokens=tuple(int(r[0]) for r in rows),
            output_tokens=tuple(int(r[1]) for r in rows),
            finish_reasons=tuple(str(r[2]) for r in rows),
            command=str(data.get("command", "")),
        )


def trace_path(workload: str) -> Path:
    return TRACE_DIR / f"{workload}.json"


def load_trace(name_or_path: str | Path) -> LengthTrace:
    """A shipped trace by workload name (`chat`, ...) or any trace file by path."""
    path = trace_path(str(name_or_path)) if str(name_or_path) in WORKLOADS else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace {str(name_or_path)!r}: use one of {sorted(WORKLOADS)} or a trace file path"
        )
    return LengthTrace.from_json(json.loads(path.read_text(encoding="utf-8")))


def save_trace(trace: LengthTrace, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace.to_json(), separators=(",", ":")) + "\n", encoding="utf-8")


# -- recording (needs the model: imports the engine lazily) --------------------------------------------
def record_trace(
    workload: str, llm: Any, command: str = "", limit: int | None = None, max_tokens: int | None = None
) -> LengthTrace:
    """Run `workload` through `llm` (a `dataplane.LLM`), greedy, stopping at EOS or max_tokens.

    `limit` keeps only the first requests (conversations for customer-service) and
    `max_tokens` overrides the workload's cap: both for quick checks.
    """
    from pagedserve.benchmarks.dialogues import customer_service_dialogues
    from pagedserve.benchmarks.workloads import chat_prompts, long_context_prompts
    from pagedserve.dataplane import SamplingParams

    spec = WORKLOADS[workload]
    tok = llm.tokenizer
    if tok is None:
        raise ValueError("recording a trace needs a model with a tokenizer")
    cap = max_tokens or spec.max_tokens
    params = SamplingParams(max_tokens=cap, temperature=0.0)
    rows: list[tuple[int, int, str]] = []
    if workload == "customer-service":
        dialogues = customer_service_dialogues(limit or 32)
        replies: list[list[str]] = [[] for _ in dialogues]
        by_dialogue: list[list[tuple[int, int, str]]] = [[] for _ in dialogues]
        # Turn by turn: every conversation's turn k runs in one batch, with its real replies.
        for k in range(max(d.num_turns for d in dialogues)):
            live = [i for i, d in enumerate(dialogues) if d.num_turns > k]
            prompts = [llm.apply_chat_template(dialogues[i].messages(replies[i])) for i in live]
            outs = llm.generate(prompts, params, use_tqdm=True)
            for i, out in zip(live, outs, strict=True):
                replies[i].append(out.text.strip())
                by_dialogue[i].append((out.num_prompt_tokens, out.num_output_tokens, out.finish_reason))
        rows = [r for turns in by_dialogue for r in turns]
    else:
        if workload == "chat":
            prompts = chat_prompts(tok, limit or 64)
        else:
            prompts = long_context_prompts(tok, limit or 16)
        outs = llm.generate(prompts, params, use_tqdm=True)
        rows = [(o.num_prompt_tokens, o.num_output_tokens, o.finish_reason) for o in outs]
    return LengthTrace(
        workload=workload,
        description=spec.description,
        model=Path(str(llm.engine.model_path)).name,
        max_tokens=cap,
        prompt_tokens=tuple(r[0] for r in rows),
        output_tokens=tuple(r[1] for r in rows),
        finish_reasons=tuple(r[2] for r in rows),
        command=command,
    )


# -- the `trace` subcommand ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", nargs="+", default=["all"], choices=["all", *WORKLOADS])
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="store name or local HF folder")
    p.add_argument(
        "--trace-dir", type=Path, default=TRACE_DIR, help="where the traces go (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="first N requests (conversations) only: for tests (default: all)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="override each workload's cap on new tokens (default: the workload's own)",
    )


def run(args: argparse.Namespace, report: Any) -> dict[str, Any]:
    from pagedserve.dataplane import LLM

    names = list(WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload))
    llm = LLM(
        args.model, dtype="float32", max_num_seqs=64, kv_cache_memory=2 * 2**30, num_threads=args.threads
    )
    rows, out = [], {}
    for name in report.progress(names, desc="workloads"):
        trace = record_trace(name, llm, report.command, args.limit, args.max_tokens)
        path = args.trace_dir / f"{name}.json"
        save_trace(trace, path)
        rows.append([name, str(trace.num_requests), trace.summary(), str(path)])
        out[name] = trace.to_json()
    report.table("Recorded length traces", ["workload", "requests", "lengths", "file"], rows)
    return {"traces": out}
