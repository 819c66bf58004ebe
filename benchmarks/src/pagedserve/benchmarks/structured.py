"""Structured outputs: constrained vs unconstrained decoding on the same prompts, same run.

    pagedserve bench structured [--streams 16] [--rounds 3] [--json out.json]

One engine on the default model. `--streams` chat prompts run as one concurrent batch, each
with a JSON schema from benchmarks/src/pagedserve/benchmarks/data/schemas.json (greedy, `--max-tokens`):

1. Compile time: every schema of the set compiled cold, one after another, through the
   engine's compile service (child process, as the server does); p50 / p99 / max.
2. Rounds, interleaved, after one prefill of the prompts (each round starts from the same
   cached prompt blocks): the constrained batch (grammars cached), then the same prompts
   unconstrained with `ignore_eos` and each prompt's `max_tokens` set to the length its
   constrained output had, so both runs generate exactly the same number of tokens. The
   ratio is constrained tokens/s over unconstrained tokens/s, per round and its median.
3. Mask work: the time the steps waited for grammar bitmasks (what was left of the fill
   after the forward, and the masking) in the constrained rounds, as a share of those rounds'
   time (nearly all of it engine steps); and the fills' own time, which runs on a worker
   thread overlapping the forward.

Every constrained output that finished with "stop" is checked against its schema
(`jsonschema`, when installed): the count of valid outputs is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import default_model, phase
from pagedserve.benchmarks.workloads import chat_prompts
from pagedserve.common.constraints import Constraint
from pagedserve.common.settings import ArgumentParser
from pagedserve.dataplane import LLM, SamplingParams

SCHEMAS_FILE = Path(__file__).parent / "data" / "schemas.json"
INSTRUCTION = "Answer with one JSON value for this request and nothing else.\n\n"


def load_schemas() -> list[dict[str, Any]]:
    schemas: list[dict[str, Any]] = json.loads(SCHEMAS_FILE.read_text())
    return schemas


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pagedserve bench structured", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=default_model(), help="store name or local Hugging Face folder")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests, one batch")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved constrained / unconstrained rounds"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per constrained output")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures here (default: print only)"
    )
    return parser


def _timed(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[Any], float, float, float]:
    """Outputs, wall seconds, the seconds steps waited for grammar masks and the seconds the
    fills took (overlapped)."""
    runner = llm.engine.runner
    mask_before, fill_before = runner.mask_seconds, runner.mask_fill_seconds
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    return outs, wall, runner.mask_seconds - mask_before, runner.mask_fill_seconds - fill_before


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    llm = phase("engine", lambda: LLM(args.model, max_num_seqs=max(16, args.streams)))
    tokenizer = llm.tokenizer
    schemas = load_schemas()
    service = llm.engine.grammars()

    def compile_all() -> list[float]:
        seconds = []
        for schema in schemas:
            started = time.perf_counter()
            service.compile(Constraint("json_schema", json.dumps(schema)))
            seconds.append(time.perf_counter() - started)
        return seconds

    service.compile(Constraint("regex", "warm-up"))  # the compile child's start is not a compile
    compile_seconds = phase("compile the schema set", compile_all)

    base = chat_prompts(tokenizer, n=args.streams, min_tokens=20, max_tokens=120)
    prompts = []
    constrained = []
    for i, ids in enumerate(base):
        question = tokenizer.decode(ids, skip_special_tokens=True)
        schema = schemas[i % len(schemas)]
        prompt = llm.apply_chat_template(
            [{"role": "user", "content": INSTRUCTION + question + "\nSchema: " + json.dumps(schema)}]
        )
        prompts.append(
            prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
        )
        constraint = Constraint("json_schema", json.dumps(schema))
        constrained.append(SamplingParams(max_tokens=args.max_tokens, temperature=0.0, constraint=constraint))

    # The prompts' prefill, once: every round then starts from the same cached prompt blocks
    # (otherwise the first constrained round alone would pay the cold prefill).
    phase("prefill the prompts", lambda: llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False))
    rounds: list[dict[str, float]] = []
    valid = finished = 0
    mask_total = fill_total = step_total = 0.0
    for r in range(args.rounds):
        outs, wall_c, mask_c, fill_c = phase(
            f"constrained, round {r + 1}", lambda: _timed(llm, prompts, constrained)
        )
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        _, wall_u, _, _ = phase(f"unconstrained, round {r + 1}", partial(_timed, llm, prompts, plain))
        tokens = sum(lengths)
        rounds.append(
            {
                "tokens": tokens,
                "constrained_tok_s": tokens / wall_c,
                "unconstrained_tok_s": tokens / wall_u,
                "ratio": wall_u / wall_c,
            }
        )
        mask_total += mask_c
        fill_total += fill_c
        step_total += wall_c
        if r == 0:
            for out, i in zip(outs, range(len(outs)), strict=True):
                if out.outputs[0].finish_reason != "stop":
                    continue
                finished += 1
                try:
                    import jsonschema

                    jsonschema.validate(json.loads(out.outputs[0].text), schemas[i % len(schemas)])
                    valid += 1
                except ImportError:
                    json.loads(out.outputs[0].text)
                    valid += 1
                except Exception:
                    pass
    llm.engine.close()

    ratio = statistics.median(x["ratio"] for x in rounds)
    results = {
        "streams": args.streams,
        "compile_seconds": {
            "schemas": len(compile_seconds),
            "p50": percentile(compile_seconds, 0.5),
            "p99": percentile(compile_seconds, 0.99),
            "max": max(compile_seconds),
        },
        "rounds": rounds,
        "median_ratio": ratio,
        "mask_share_of_step_time": mask_total / step_total if step_total else 0.0,
        "fill_share_overlapped": fill_total / step_total if step_total else 0.0,
        "outputs": {"finished_stop": finished, "valid": valid, "total": len(prompts)},
    }
    c = results["compile_seconds"]
    print(
        f"compile: {c['schemas']} schemas cold, p50 {1000 * c['p50']:.1f} ms, p99 {1000 * c['p99']:.1f} ms, "
        f"max {1000 * c['max']:.1f} ms"
    )
    print("| round | tokens | constrained tok/s | unconstrained tok/s | ratio |")
    print("|---|---|---|---|---|")
    for i, x in enumerate(rounds, 1):
        print(
            f"| {i} | {x['tokens']} | {x['constrained_tok_s']:.1f} | {x['unconstrained_tok_s']:.1f} | {x['ratio']:.2f}x |"
        )
    print(f"median constrained / unconstrained: {ratio:.2f}x at {args.streams} streams")
    print(
        f"mask work on the steps' path: {100 * results['mask_share_of_step_time']:.2f} % of the constrained "
        f"rounds' time (fills, overlapping the forwards: {100 * results['fill_share_overlapped']:.2f} %)"
    )
    print(f"outputs: {finished}/{len(prompts)} finished with stop, {valid} of them valid under their schema")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
