"""KV cache quality (bf16 and FP8 against the model's dtype): memory, greedy agreement with the 16/32-bit cache, and perplexity.

    .venv/bin/python -m pagedserve.benchmarks.fp8_quality --json benchmarks/results/fp8_quality.json

Not a timing benchmark: the figures do not depend on machine load. For each
`--kv-cache-dtype` (auto, bfloat16, fp8_e4m3, fp8_e5m2), one engine on the default model (fp32
weights, per-layer K/V scales calibrated at start-up as the server does):

1. KV bytes per token and the block count at a fixed `--kv-cache-memory` (the budget formula).
2. Perplexity of `benchmarks/src/pagedserve/benchmarks/data/passages.txt` (plain English, ~3,700 SmolLM2 tokens),
   fed as one sequence in `--chunk`-token prefill chunks through the paged cache: every
   chunk attends to the quantized K/V of all earlier tokens and its own, exactly as in
   serving (the cache is written before attention reads it).
3. Greedy decoding of `--num-prompts` chat prompts (pagedserve.benchmarks.workloads.chat_prompts,
   20-300 tokens) for `--max-tokens` tokens each, `ignore_eos`. Agreement with `auto`:
   token agreement = tokens equal to auto's up to each prompt's first divergence, over all
   tokens (after a divergence the continuations are different texts, not errors); also the
   share of prompts that are identical throughout, and the mean first-divergence position.

Quick plumbing check: `--num-prompts 2 --max-tokens 4 --max-ppl-tokens 256`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedserve.benchmarks.common import default_model, phase
from pagedserve.benchmarks.workloads import PASSAGES_FILE, chat_prompts
from pagedserve.common.models import resolve_model_path
from pagedserve.common.settings import ArgumentParser, parse_bytes
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.models import PagedStep
from pagedserve.dataplane.runner.model_loader import load_tokenizer
from pagedserve.kernels import build_attention_metadata

KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: Sequence[int], chunk: int) -> float:
    """exp(mean NLL) of token_ids, computed in prefill chunks through the engine's paged cache.

    Writes the sequence into blocks 0.. of the engine's pool directly: call it on an idle
    engine before anything is cached (it does not go through the block manager).
    """
    runner = llm.engine.runner
    block_size = runner.block_size
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size)
    if num_blocks > llm.engine.budget.num_blocks:
        raise ValueError("the perplexity text does not fit in the KV pool; raise --kv-cache-memory")
    table = list(range(num_blocks))
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    nll = 0.0
    for start in range(0, n - 1, chunk):
        end = min(n, start + chunk)
        meta = build_attention_metadata([end - start], [end], [table], block_size, runner.device)
        step = PagedStep(meta, runner.kv_caches, runner.backends, kv_scales=runner.kv_scales)
        hidden = runner.model(ids[start:end], torch.arange(start, end, device=runner.device), step)
        targets = ids[start + 1 : end + 1]
        logits = runner.model.compute_logits(hidden[: targets.shape[0]]).float()
        nll -= float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
    return math.exp(nll / (n - 1))


def agreement(ours: Sequence[Sequence[int]], base: Sequence[Sequence[int]]) -> dict[str, float]:
    matched, total, identical, first_div = 0, 0, 0, []
    for a, b in zip(ours, base, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        matched += k
        total += len(b)
        identical += k == len(b)
        first_div.append(k)
    return {
        "token_agreement": matched / total,
        "identical_prompts": identical / len(base),
        "mean_first_divergence": sum(first_div) / len(first_div),
    }


def run_one(
    args: argparse.Namespace, kv_dtype: str, ppl_ids: list[int], prompts: list[list[int]]
) -> dict[str, Any]:
    llm = LLM(
        args.model,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
    )
    engine = llm.engine
    out: dict[str, Any] = {
        "kv_cache_dtype": kv_dtype,
        "bytes_per_token": engine.budget.shape.bytes_per_token,
        "num_blocks": engine.budget.num_blocks,
        "kv_scales": None
        if engine.kv_scales is None
        else {
            "source": engine.kv_scales.source,
            "k": list(engine.kv_scales.k_scale),
            "v": list(engine.kv_scales.v_scale),
        },
    }
    out["perplexity"] = phase(f"{kv_dtype}: perplexity", lambda: perplexity(llm, ppl_ids, args.chunk))
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outputs = phase(f"{kv_dtype}: greedy", lambda: llm.generate(prompts, params, use_tqdm=False))
    out["generate_seconds"] = time.perf_counter() - t
    out["tokens"] = [o.token_ids for o in outputs]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="pagedserve bench fp8-quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model(), help="store name or local Hugging Face folder")
    ap.add_argument(
        "--kv-cache-dtypes", default=",".join(KV_DTYPES), help="comma-separated; auto is the baseline"
    )
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default="2GiB", help="KV pool size")
    ap.add_argument("--num-prompts", type=int, default=64, help="chat prompts decoded greedily")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    ap.add_argument("--chunk", type=int, default=512, help="perplexity prefill chunk, tokens")
    ap.add_argument(
        "--max-ppl-tokens", type=int, default=None, help="truncate the perplexity text (default: all of it)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    ap.add_argument("--json", default=None, help="write the results here (default: print only)")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    dtypes = args.kv_cache_dtypes.split(",")
    if dtypes[0] != "auto":
        dtypes.insert(0, "auto")
    tokenizer = load_tokenizer(resolve_model_path(args.model, None))
    assert tokenizer is not None, "the perplexity text needs the model's tokenizer"
    ppl_ids: list[int] = tokenizer.encode(PASSAGES_FILE.read_text(), add_special_tokens=False)
    ppl_ids = ppl_ids[: args.max_ppl_tokens] if args.max_ppl_tokens else ppl_ids
    prompts = chat_prompts(tokenizer, n=args.num_prompts)
    results = [run_one(args, d, ppl_ids, prompts) for d in dtypes]
    base = results[0]
    rows = []
    for r in results:
        agree = agreement(r["tokens"], base["tokens"])
        rows.append(
            {
                "kv_cache_dtype": r["kv_cache_dtype"],
                "bytes_per_token": r["bytes_per_token"],
                "num_blocks": r["num_blocks"],
                "blocks_vs_auto": r["num_blocks"] / base["num_blocks"],
                "perplexity": r["perplexity"],
                "ppl_increase": r["perplexity"] / base["perplexity"] - 1.0,
                **agree,
                "generate_seconds": r["generate_seconds"],
                "kv_scales": r["kv_scales"],
            }
        )
    mem = args.kv_cache_memory / 2**30
    print(
        f"\nKV cache quality — {args.model}, fp32 weights; budget {mem:g} GiB; perplexity on "
        f"{len(ppl_ids)} tokens ({args.chunk}-token chunks); greedy {len(prompts)} prompts x {args.max_tokens} tokens\n"
    )
    print(
        "| kv_cache_dtype | KV bytes/token | blocks @ budget | perplexity | Δ ppl | token agreement | identical prompts | mean first divergence |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['kv_cache_dtype']} | {row['bytes_per_token']:,} | {row['num_blocks']:,} ({row['blocks_vs_auto']:.0f}x) "
            f"| {row['perplexity']:.4f} | {100 * row['ppl_increase']:+.2f} % | {100 * row['token_agreement']:.1f} % "
            f"| {100 * row['identical_prompts']:.1f} % | {row['mean_first_divergence']:.1f} / {args.max_tokens} |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: v for k, v in vars(args).items()}, "ppl_tokens": len(ppl_ids), "rows": rows}
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
