"""Quantized weights: our engine on a GGUF file served quantized, against our fp32 engine on the
same weights de-quantized and, with `--peers llama.cpp`, llama.cpp on the same file.

    pagedserve bench quantized [--peers llama.cpp] [--threads 2] [--json out.json]

The default pair is the default model's own Q4_1 file (`SmolLM2-135M-Instruct-Q4_1`) and its
fp32 conversion (`SmolLM2-135M-Instruct`); `models pull` makes both. The same chat prompts,
as token ids, go to every engine, greedy, a fixed number of new tokens each:

1. Single stream: one prompt, `--single-tokens` new tokens: tokens/s (prefill included).
2. `--prompts` prompts, `--batch-tokens` each: ours as one batch (continuous batching), llama.cpp
   one after the other (its Python binding serves one sequence at a time): tokens/s.
3. Agreement: per prompt of run 2, the length of the prefix of the first 32 tokens where
   llama.cpp's tokens equal ours (llama.cpp rounds activations to 8 bits for its dot
   products; we keep them fp32), mean over prompts, as a share of 32.
4. Weight bytes in memory after load (packed panels, quantized values and scales), ours
   quantized over ours fp32.

The llama.cpp venv is built on first use (benchmarks/src/pagedserve/benchmarks/llamacpp_env.py: 20+ min of compiling).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import cpu_line, phase
from pagedserve.benchmarks.workloads import SHORT_QUESTIONS
from pagedserve.common.settings import ArgumentParser

AGREEMENT_TOKENS = 32


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pagedserve bench quantized", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--model", default="SmolLM2-135M-Instruct-Q4_1", help="a GGUF store name or .gguf path"
    )
    parser.add_argument("--fp32-model", default="SmolLM2-135M-Instruct", help="the same weights in fp32")
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=["llama.cpp"],
        help="peers to run as well (default: none, ours only)",
    )
    parser.add_argument("--threads", type=int, default=2, help="threads for every engine")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the batched run")
    parser.add_argument("--single-tokens", type=int, default=128, help="new tokens of the single stream")
    parser.add_argument("--batch-tokens", type=int, default=64, help="new tokens per prompt, batched run")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures here (default: none, print only)"
    )
    return parser


def run_ours(model: str, runs: dict[str, dict[str, Any]], threads: int) -> dict[str, Any]:
    from pagedserve.dataplane import LLM, SamplingParams
    from pagedserve.dataplane.runner.quant_linear import weight_bytes

    t = time.perf_counter()
    llm = LLM(model, num_threads=threads, kv_cache_memory=256 << 20, max_num_seqs=64)
    load_s = time.perf_counter() - t
    llm.generate(runs["single"]["prompts"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    out: dict[str, Any] = {
        "load_seconds": load_s,
        "weight_bytes": weight_bytes(llm.engine.runner.model),
        "runs": {},
    }
    for name, run in runs.items():
        params = SamplingParams(max_tokens=run["max_tokens"], temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        results = llm.generate(run["prompts"], params, use_tqdm=False)
        out["runs"][name] = {
            "seconds": time.perf_counter() - t,
            "outputs": [list(r.token_ids) for r in results],
        }
    del llm
    return out


def run_llamacpp(gguf: Path, runs: dict[str, dict[str, Any]], threads: int) -> dict[str, Any]:
    from pagedserve.benchmarks.llamacpp_env import ensure_llamacpp_python

    python = ensure_llamacpp_python()
    script = Path(__file__).with_name("llamacpp_peer.py")
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"gguf": str(gguf), "threads": threads, "runs": runs}))
        subprocess.run([python, str(script), str(job), str(result)], check=True)
        figures: dict[str, Any] = json.loads(result.read_text())
    return figures


def tokens_per_second(result: dict[str, Any], name: str) -> float:
    run = result["runs"][name]
    return sum(len(o) for o in run["outputs"]) / run["seconds"]


def agreeing_prefix(ours: list[list[int]], peer: list[list[int]]) -> float:
    lengths = []
    for a, b in zip(ours, peer, strict=True):
        n = next(
            (
                i
                for i, (x, y) in enumerate(zip(a[:AGREEMENT_TOKENS], b[:AGREEMENT_TOKENS], strict=False))
                if x != y
            ),
            None,
        )
        lengths.append(min(AGREEMENT_TOKENS, len(a), len(b)) if n is None else n)
    return sum(lengths) / len(lengths) / AGREEMENT_TOKENS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedserve.common.models import resolve_model_path
    from pagedserve.common.models.gguf_folder import gguf_weights_file
    from pagedserve.controlplane.tokenizer import Tokenizer

    folder = resolve_model_path(args.model)
    gguf = gguf_weights_file(folder)
    if gguf is None:
        print(f"{args.model} is not a GGUF model", file=sys.stderr)
        return 1
    tokenizer = Tokenizer(folder)
    questions = (SHORT_QUESTIONS * (1 + args.prompts // len(SHORT_QUESTIONS)))[: args.prompts]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in questions
    ]
    runs = {
        "single": {"prompts": prompts[:1], "max_tokens": args.single_tokens},
        "batch": {"prompts": prompts, "max_tokens": args.batch_tokens},
    }
    print(cpu_line())
    results: dict[str, Any] = {
        "quantized": phase(f"ours, {args.model}", lambda: run_ours(args.model, runs, args.threads)),
        "fp32": phase(f"ours, {args.fp32_model}", lambda: run_ours(args.fp32_model, runs, args.threads)),
    }
    if "llama.cpp" in args.peers:
        results["llama.cpp"] = phase("llama.cpp", lambda: run_llamacpp(gguf, runs, args.threads))
    print(f"| engine | single stream tok/s | {args.prompts} prompts tok/s |")
    print("|---|---|---|")
    for name, result in results.items():
        print(
            f"| {name} | {tokens_per_second(result, 'single'):.1f} | {tokens_per_second(result, 'batch'):.1f} |"
        )
    quant, fp32 = results["quantized"], results["fp32"]
    print(f"quantized / fp32 (ours): single {tokens_per_second(quant, 'single') / tokens_per_second(fp32, 'single'):.2f}x, "
          f"batch {tokens_per_second(quant, 'batch') / tokens_per_second(fp32, 'batch'):.2f}x; weight bytes "
          f"{quant['weight_bytes'] / 1e6:.1f} MB vs {fp32['weight_bytes'] / 1e6:.1f} MB "
          f"({quant['weight_bytes'] / fp32['weight_bytes']:.2f}x)")  # fmt: skip
    same = sum(
        a == b
        for a, b in zip(quant["runs"]["batch"]["outputs"], fp32["runs"]["batch"]["outputs"], strict=True)
    )
    print(f"greedy outputs equal to our fp32 engine's: {same}/{len(prompts)}")
    if "llama.cpp" in results:
        peer = results["llama.cpp"]
        print(f"vs llama.cpp {peer.get('version', '')}: single {tokens_per_second(quant, 'single') / tokens_per_second(peer, 'single'):.2f}x, "
              f"{args.prompts} prompts {tokens_per_second(quant, 'batch') / tokens_per_second(peer, 'batch'):.2f}x; "
              f"mean agreeing prefix {agreeing_prefix(quant['runs']['batch']['outputs'], peer['runs']['batch']['outputs']):.2f} "
              f"of {AGREEMENT_TOKENS} tokens")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps(
                {"cpu": cpu_line(), "args": vars(args) | {"json": str(args.json)}, "results": results},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
