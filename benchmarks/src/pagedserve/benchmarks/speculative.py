"""Speculative decoding: our engine with and without drafting, on four workloads, same run.

    pagedserve bench speculative [--streams 1 16] [--max-tokens 192] [--peers llama.cpp] [--json out.json]

Workloads (built here, from text shipped with the package; greedy, each prompt's output ends
at EOS or `--max-tokens`):

1. code editing: the prompt holds a 100-300-line source file of this package and asks for
   it back with one identifier renamed (the answer repeats most of the prompt);
2. document QA: a passage of the shipped data/passages.txt and a request to quote the
   sentences that answer a question (the answer quotes the prompt);
3. JSON echo: a record in the prompt to be copied under its JSON schema (structured output;
   every output is parsed and counted);
4. open chat: the throughput benchmark's chat prompts (little repetition).

Per workload and stream count, one engine per drafting method (`ngram`, `suffix`) runs the
prompts without drafting (`SamplingParams(speculative=False)`) and with it, alternating, after
one warm pass that leaves every prompt in the prefix cache. One stream: the prompts one after
the other; N streams: N prompts in one batch. The table shows output tokens/s, the ratio
against no drafting, the mean accepted tokens per verified draft, and how many outputs are
token for token those of the run without drafting (greedy: all of them, or it is a bug).

`--peers llama.cpp` adds llama-cpp-python's prompt-lookup decoding
(`LlamaPromptLookupDecoding`) on the GGUF file the default model is made from, one stream, on
each workload
(its venv is built on first use: benchmarks/llamacpp_env.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import cpu_line, default_model, phase
from pagedserve.benchmarks.workloads import DATA_DIR, chat_prompts
from pagedserve.common.constraints import Constraint
from pagedserve.common.settings import ArgumentParser, parse_bytes
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.engine.speculator import make_drafter

# Source files of this package the code-editing prompts hold, and the identifier each renames.
CODE_FILES: tuple[tuple[str, str, str], ...] = (
    ("dataplane/request.py", "num_computed_tokens", "computed_count"),
    ("dataplane/kvcache/budget.py", "block_size", "tokens_per_block"),
    ("dataplane/scheduler/priority.py", "request", "req"),
    ("dataplane/speculative/policy.py", "rate", "acceptance_rate"),
)
QUESTIONS = (
    "What does the passage say about how things changed over time?",
    "Which people does the passage mention, and what did they do?",
    "What numbers or dates appear in the passage?",
    "What is the main point of the passage?",
)
METHODS = ("ngram", "suffix")
# The GGUF file the default model is made from (`pagedserve pull`): llama.cpp's input.
PEER_GGUF = "SmolLM2-135M-Instruct-Q4_1"
WORKLOADS = ("code", "qa", "json", "chat")
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "name", "email", "city", "tags"],
}
NAMES = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth")
CITIES = ("London", "Manchester", "New York", "Amsterdam", "Boston", "Stanford")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pagedserve bench speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the default model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrent streams per run")
    parser.add_argument("--max-tokens", type=int, default=192, help="most output tokens per prompt")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=5, help="k: most drafted tokens per step"
    )
    parser.add_argument(
        "--single-stream-prompts", type=int, default=4, help="prompts run one after the other"
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=["llama.cpp"],
        help="peers to run beside ours (default: none)",
    )
    parser.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"), help="each engine's KV pool"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="write the results here (default: not written)"
    )
    return parser


def constraint(workload: str) -> Constraint | None:
    return Constraint("json_schema", json.dumps(RECORD_SCHEMA)) if workload == "json" else None


def _package_root() -> Path:
    import pagedserve.dataplane

    return Path(pagedserve.dataplane.__file__).resolve().parent.parent


def workload_prompts(llm: LLM, name: str, n: int) -> list[list[int]]:
    """`n` prompts (token ids) of workload `name`."""
    if name == "chat":
        return chat_prompts(llm.tokenizer, n=n, min_tokens=20, max_tokens=200)
    prompts = []
    if name == "json":
        for i in range(n):
            person = NAMES[i % len(NAMES)]
            record = {
                "id": 1000 + i,
                "name": person,
                "email": person.lower().replace(" ", ".") + "@example.com",
                "city": CITIES[i % len(CITIES)],
                "tags": ["customer", "priority" if i % 2 else "standard", f"region-{i % 5}"],
            }
            ask = f"Copy this customer record as JSON, unchanged:\n{json.dumps(record)}"
            prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
        return prompts
    if name == "code":
        root = _package_root()
        for i in range(n):
            path, old, new = CODE_FILES[i % len(CODE_FILES)]
            source = (root / path).read_text()
            ask = (
                f"Here is a Python file:\n```python\n{source}```\nRewrite the whole file with every "
                f"`{old}` renamed to `{new}`. Output only the complete file."
            )
            prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
        return prompts
    passages = [p for p in (DATA_DIR / "passages.txt").read_text().split("\n") if len(p) > 200]
    for i in range(n):
        passage = passages[i % len(passages)]
        question = QUESTIONS[i % len(QUESTIONS)]
        ask = f"{passage}\n\n{question} Answer by quoting the passage's sentences word for word."
        prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
    return prompts


def _run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, streams: int
) -> tuple[float, list[list[int]]]:
    """Seconds and outputs of `prompts`: one after the other (1 stream) or in one batch."""
    started = time.perf_counter()
    if streams == 1:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outs]


def _measure(
    llm: LLM, prompts: list[list[int]], max_tokens: int, streams: int, constraint: Constraint | None = None
) -> dict[str, Any]:
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=False, constraint=constraint)
    drafted = SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=constraint)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # prompts cached
    spec = llm.engine.speculator
    assert spec is not None
    before = (spec.stats.runs, spec.stats.accepted_tokens, spec.stats.drafted_tokens)
    t_plain, out_plain = _run(llm, prompts, plain, streams)
    # A fresh drafter: the suffix drafter learns finished outputs, and the run without drafts
    # just produced the very outputs the run with them is to generate.
    spec.drafter = make_drafter(spec.config)
    t_spec, out_spec = _run(llm, prompts, drafted, streams)
    tokens = sum(len(o) for o in out_plain)
    runs = spec.stats.runs - before[0]
    return {
        "tokens": tokens,
        "plain_tok_s": tokens / t_plain,
        "spec_tok_s": sum(len(o) for o in out_spec) / t_spec,
        "speedup": (sum(len(o) for o in out_spec) / t_spec) / (tokens / t_plain),
        "accepted_per_draft": (spec.stats.accepted_tokens - before[1]) / runs if runs else 0.0,
        "drafted_tokens": spec.stats.drafted_tokens - before[2],
        "identical": sum(a == b for a, b in zip(out_plain, out_spec, strict=True)),
        "valid_json": sum(_parses(llm, o) for o in out_spec) if constraint is not None else None,
        "prompts": len(prompts),
        "outputs": out_plain,
    }


def _parses(llm: LLM, output: list[int]) -> bool:
    try:
        json.loads(llm.tokenizer.decode(output, skip_special_tokens=True))
    except ValueError:
        return False
    return True


def _engine(model: str, args: argparse.Namespace, config: str) -> LLM:
    return LLM(
        model,
        max_num_seqs=max(args.streams),
        speculative_config=config,
        kv_cache_memory=args.kv_cache_memory,
        swap_space=0,
    )


def _llamacpp(prompts: dict[str, list[list[int]]], max_tokens: int, k: int) -> dict[str, Any]:
    import subprocess
    import tempfile

    from pagedserve.benchmarks.llamacpp_env import ensure_llamacpp_python
    from pagedserve.common.models import resolve_model_path
    from pagedserve.common.models.gguf_folder import gguf_weights_file

    gguf = gguf_weights_file(resolve_model_path(PEER_GGUF))
    if gguf is None:
        return {"error": f"{PEER_GGUF} is not a GGUF model"}
    python = ensure_llamacpp_python()
    runs = {name: {"prompts": p, "max_tokens": max_tokens} for name, p in prompts.items()}
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(
            json.dumps(
                {"gguf": str(gguf), "threads": 2, "runs": runs, "prompt_lookup": k, "stop_at_eos": True}
            )
        )
        script = Path(__file__).with_name("llamacpp_peer.py")
        subprocess.run([python, str(script), str(job), str(result)], check=True)
        data: dict[str, Any] = json.loads(result.read_text())
        return data


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or default_model()
    k = args.num_speculative_tokens
    print(f"bench speculative: {model}, k={k}, max_tokens={args.max_tokens}; {cpu_line()}")
    engines = {}
    for method in METHODS:
        config = json.dumps(
            {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        )
        engines[method] = phase(f"engine ({method})", partial(_engine, model, args, config))
    results: dict[str, Any] = {"model": model, "cpu": cpu_line(), "k": k, "runs": []}
    single: dict[str, list[list[int]]] = {}
    for workload in args.workloads:
        for streams in args.streams:
            n = args.single_stream_prompts if streams == 1 else streams
            for method, llm in engines.items():
                prompts = workload_prompts(llm, workload, n)
                if streams == 1:
                    single[workload] = prompts
                row = phase(
                    f"{workload}, {streams} stream(s), {method}",
                    partial(_measure, llm, prompts, args.max_tokens, streams, constraint(workload)),
                )
                row.update(workload=workload, streams=streams, method=method)
                results["runs"].append(row)
                print(
                    f"  {workload:5s} {streams:3d} streams {method:6s}: {row['plain_tok_s']:7.1f} -> "
                    f"{row['spec_tok_s']:7.1f} tok/s ({row['speedup']:.2f}x), {row['accepted_per_draft']:.2f} "
                    f"accepted per draft, identical {row['identical']}/{row['prompts']}"
                    + (
                        f", valid JSON {row['valid_json']}/{row['prompts']}"
                        if row["valid_json"] is not None
                        else ""
                    )
                )
    if "llama.cpp" in args.peers and single:
        peer = phase("llama.cpp prompt lookup", lambda: _llamacpp(single, args.max_tokens, k))
        results["llama.cpp"] = peer
        for name, run in peer.get("runs", {}).items():
            tokens = sum(len(o) for o in run["outputs"])
            print(
                f"  llama.cpp {peer.get('version')} prompt lookup, {name}, 1 stream: {tokens / run['seconds']:.1f} tok/s"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0
