"""Weight-precision quality: perplexity, greedy agreement and logit margins of fp32, bf16
weights and `--quantization int8`, on a real-weight model and on a random-weight layout.

    pagedserve bench quality [--models SmolLM2-135M-Instruct,shape:qwen2-0.5b] [--json out.json]

Not a timing benchmark: every figure is independent of machine load. For each model
(a store name, a folder, or `shape:NAME` for benchmarks/model_shapes.py's layouts) and each
variant of VARIANTS, one engine (fp32 activations and KV cache):

1. Teacher-forced pass over `benchmarks/data/passages.txt` (the fixed English text the KV and
   GGUF quality benchmarks use too), prefilled in chunks through the paged cache: perplexity,
   and at every position the argmax. fp32 is the reference: its top-1 / top-2 logit margin at
   each position, and each variant's margin between the same two tokens, so the table shows
   how far a variant's rounding moves a decision against how close the decisions are.
2. Greedy decoding of `--num-prompts` chat prompts (workloads.chat_prompts) for
   `--max-tokens` tokens, `ignore_eos`: prompts identical to fp32's, tokens equal up to the
   first divergence, and fp32's own top-1 / top-2 log-probability margin at each prompt's
   first divergence (a near-tie there means rounding chose, not a bug).

Why both models: a random-weight model's logits are nearly flat, so its top-2 margins are
tiny and any rounding flips greedy choices; one flip makes the rest of the text differ.
Agreement figures on random weights say little about a quantization's quality; the real
model's say what users get.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import cpu_line, default_model, phase
from pagedserve.common.settings import ArgumentParser

# Variant -> the engine settings it adds to an fp32 engine. int8-weights multiplies the int8
# weights by fp32 activations: beside int8 it tells the weights' rounding from the activations'.
VARIANTS: dict[str, dict[str, str]] = {
    "fp32": {},
    "bf16": {"cpu_weight_dtype": "bfloat16"},
    "int8-weights": {"quantization": "int8", "quantized_matmul": "float32"},
    "int8": {"quantization": "int8", "quantized_matmul": "auto"},
}
MARGIN_QUANTILES = (0.1, 0.5, 0.9)
# Top-1 / top-2 logit margins counted as near-ties in the table (absolute, in logits).
TIE_MARGINS = (0.01, 0.1)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="pagedserve bench quality", description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--models",
        default=f"{default_model()},shape:qwen2-0.5b",
        help="comma-separated: store names, folders, or shape:NAME (benchmarks/model_shapes.py)",
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS; fp32 always runs"
    )
    ap.add_argument("--max-ppl-tokens", type=int, default=1024, help="truncate the perplexity text")
    ap.add_argument("--chunk", type=int, default=256, help="perplexity prefill chunk, tokens")
    ap.add_argument("--num-prompts", type=int, default=48, help="chat prompts decoded greedily")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument(
        "--reference-int8",
        action="store_true",
        help="also run transformers' own fp32 forward with every linear's weights replaced by their "
        "per-channel int8 de-quantization (and per block of 32): what int8-weights should measure",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here (default: print only)")
    return ap


def resolve(model: str) -> Path:
    from pagedserve.benchmarks.model_shapes import ensure_shape_model
    from pagedserve.common.models import resolve_model_path

    if model.startswith("shape:"):
        name = model.removeprefix("shape:")
        return Path(phase(f"model shape {name}", lambda: ensure_shape_model(name)))
    return resolve_model_path(model)


def teacher_forced(llm: Any, ids: Sequence[int], chunk: int, ref_top2: Any = None) -> dict[str, Any]:
    """NLL, argmax, top-2 tokens and their logit margin at every position of `ids` through the
    engine's paged cache (blocks 0.., on an idle engine, as fp8_quality.perplexity); with
    `ref_top2` ([n-1, 2] token ids) also this engine's margin between those two tokens."""
    import torch

    from pagedserve.dataplane.models import PagedStep
    from pagedserve.kernels import build_attention_metadata

    runner = llm.engine.runner
    bs, n = runner.block_size, len(ids)
    table = list(range(math.ceil(n / bs)))
    tokens = torch.tensor(list(ids), dtype=torch.long)
    nll, argmax, top2, own, margins = 0.0, [], [], [], []
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            end = min(n, start + chunk)
            meta = build_attention_metadata([end - start], [end], [table], bs, runner.device)
            step = PagedStep(meta, runner.kv_caches, runner.backends, kv_scales=runner.kv_scales)
            hidden = runner.model(tokens[start:end], torch.arange(start, end), step)
            targets = tokens[start + 1 : end + 1]
            logits = runner.model.compute_logits(hidden[: targets.shape[0]]).float()
            nll -= float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
            argmax.append(logits.argmax(dim=-1))
            best = logits.topk(2, dim=-1)
            top2.append(best.indices)
            own.append(best.values[:, 0] - best.values[:, 1])
            if ref_top2 is not None:
                pair = ref_top2[start : start + targets.shape[0]]
                picked = logits.gather(1, pair)
                margins.append(picked[:, 0] - picked[:, 1])
    out = {
        "perplexity": math.exp(nll / (n - 1)),
        "argmax": torch.cat(argmax),
        "top2": torch.cat(top2),
        "own_margins": torch.cat(own),
    }
    if ref_top2 is not None:
        out["margins"] = torch.cat(margins)
    return out


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens per prompt, and per prompt the top-2 log-probabilities of every position."""
    from pagedserve.dataplane import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.token_ids) for o in outs], [o.outputs[0].top_logprobs for o in outs]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))


def top2_margin(top: Sequence[tuple[int, float]]) -> float:
    """Top-1 minus top-2 log-probability (= their logit margin) from a position's top logprobs."""
    values = sorted((lp for _, lp in top), reverse=True)
    return values[0] - values[1]


def quantiles(values: Sequence[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in MARGIN_QUANTILES]


def measure(
    args: argparse.Namespace,
    path: Path,
    settings: dict[str, str],
    ids: list[int],
    prompts: list[list[int]],
    ref_top2: Any,
) -> dict[str, Any]:
    """One engine of `settings`: the teacher-forced pass, then the greedy prompts."""
    from pagedserve.dataplane import LLM

    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory=512 << 20,
        max_model_len=max(len(ids), 512) + 16,
        num_threads=args.threads,
        enable_prefix_caching=False,
        **settings,
    )
    forced = teacher_forced(llm, ids, args.chunk, ref_top2)
    tokens, tops = greedy(llm, prompts, args.max_tokens)
    return {**forced, "tokens": tokens, "tops": tops}


def reference_int8(path: Path, ids: list[int], ref_top2: Any, group: int | None) -> dict[str, Any]:
    """transformers' fp32 model of `path` in one forward over `ids`, every nn.Linear's weight
    replaced by its int8 de-quantization (per output channel, or per `group` inputs; the LM
    head untied first, so the embedding stays fp32 as the engine's does)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from pagedserve.kernels.quant import quantize_int8

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = quantize_int8(module.weight.data, group).dequantize()
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(tokens).logits[0, :-1].float()
    nll = -float(torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None]).sum())
    picked = logits.gather(1, ref_top2)
    return {
        "perplexity": math.exp(nll / (len(ids) - 1)),
        "argmax": logits.argmax(dim=-1),
        "margins": picked[:, 0] - picked[:, 1],
    }


def reference_row(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """A teacher-forced-only row (no greedy decoding) against the fp32 engine."""
    return {
        "perplexity": got["perplexity"],
        "ppl_change": got["perplexity"] / ref["perplexity"] - 1.0,
        "argmax_agreement": float((got["argmax"] == ref["argmax"]).float().mean()),
        "margin_shift": quantiles((got["margins"] - ref["own_margins"]).abs().tolist()),
        "tokens": None,
    }


def run_model(args: argparse.Namespace, model: str, variants: list[str]) -> dict[str, Any]:
    import torch

    from pagedserve.benchmarks.workloads import PASSAGES_FILE, chat_prompts
    from pagedserve.dataplane.runner.model_loader import load_tokenizer

    path = resolve(model)
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None, "the perplexity text needs the model's tokenizer"
    ids = tokenizer.encode(PASSAGES_FILE.read_text(), add_special_tokens=False)[: args.max_ppl_tokens]
    prompts = chat_prompts(tokenizer, n=args.num_prompts)
    ref: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    for variant in variants:
        got = phase(
            f"{path.name}: {variant}",
            partial(measure, args, path, VARIANTS[variant], ids, prompts, ref.get("top2")),
        )
        if not ref:
            ref = got
        divergences = [first_divergence(a, b) for a, b in zip(got["tokens"], ref["tokens"], strict=True)]
        at_divergence = [
            top2_margin(ref["tops"][p][k]) for p, k in enumerate(divergences) if k < args.max_tokens
        ]
        row: dict[str, Any] = {
            "perplexity": got["perplexity"],
            "ppl_change": got["perplexity"] / ref["perplexity"] - 1.0,
            "argmax_agreement": float((got["argmax"] == ref["argmax"]).float().mean()),
            "identical_prompts": sum(k == args.max_tokens for k in divergences),
            "token_agreement": sum(divergences) / (args.max_tokens * len(prompts)),
            "mean_first_divergence": statistics.mean(divergences),
            "fp32_margin_at_divergence": quantiles(at_divergence) if at_divergence else None,
            "tokens": got["tokens"],
        }
        if "margins" in got:
            # How far the variant's rounding moved fp32's decision between its top two tokens.
            row["margin_shift"] = quantiles((got["margins"] - ref["own_margins"]).abs().tolist())
        rows[variant] = row
    if args.reference_int8:
        for group in (None, 32):
            name = f"transformers, int8 per {'block of 32' if group else 'channel'} (reference)"
            got = phase(name, partial(reference_int8, path, ids, ref["top2"], group))
            rows[name] = reference_row(got, ref)
    margins = ref["own_margins"]
    return {
        "model": str(path),
        "name": path.name,
        "ppl_tokens": len(ids),
        "prompts": len(prompts),
        "fp32_margins": quantiles(margins.tolist()),
        "near_ties": {str(t): float((margins < t).float().mean()) for t in TIE_MARGINS},
        "rows": rows,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variants = ["fp32", *(v for v in args.variants.split(",") if v and v != "fp32")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    print(cpu_line())
    results: list[dict[str, Any]] = []
    for model in (m for m in args.models.split(",") if m):
        # Each model's tables as soon as it is done (a random-weight layout takes minutes more).
        results.append(run_model(args, model, variants))
        print_tables(results[-1:], args)
        if args.json:
            slim = [{**r, "rows": {k: {**v, "tokens": None} for k, v in r["rows"].items()}} for r in results]
            args.json.parent.mkdir(parents=True, exist_ok=True)
            payload = {"cpu": cpu_line(), "args": {k: str(v) for k, v in vars(args).items()}, "models": slim}
            args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def print_tables(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nperplexity: the first {args.max_ppl_tokens} tokens of passages.txt, teacher-forced in "
        f"{args.chunk}-token chunks; greedy: {args.num_prompts} chat prompts x {args.max_tokens} tokens, "
        "against fp32\n"
    )
    print(
        "| model | weights | perplexity | Δ ppl | argmax = fp32 (teacher-forced) | identical greedy prompts "
        "| greedy tokens before divergence | fp32 top-2 margin at first divergence (p10/p50/p90) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for name, row in r["rows"].items():
            at = row.get("fp32_margin_at_divergence")
            greedy_cells = (
                f"{row['identical_prompts']}/{r['prompts']} | {100 * row['token_agreement']:.1f} %"
                if "identical_prompts" in row
                else "- | -"
            )
            print(
                f"| {r['name']} | {name} | {row['perplexity']:.4f} | {100 * row['ppl_change']:+.2f} % "
                f"| {100 * row['argmax_agreement']:.1f} % | {greedy_cells} | "
                + ("-" if at is None else " / ".join(f"{m:.3f}" for m in at))
                + " |"
            )
    print(
        "\n| model | fp32 top-1 - top-2 logit margin (p10/p50/p90) | "
        + " | ".join(f"margin < {t}" for t in TIE_MARGINS)
        + " | variant's shift of that margin, |Δ| p10/p50/p90 |"
    )
    print("|---|---|" + "---|" * len(TIE_MARGINS) + "---|")
    for r in results:
        shifts = "; ".join(
            f"{name}: " + " / ".join(f"{m:.3f}" for m in row["margin_shift"])
            for name, row in r["rows"].items()
            if "margin_shift" in row
        )
        print(
            f"| {r['name']} | {' / '.join(f'{m:.3f}' for m in r['fp32_margins'])} | "
            + " | ".join(f"{100 * r['near_ties'][str(t)]:.1f} %" for t in TIE_MARGINS)
            + f" | {shifts} |"
        )
    for r in results:
        rows = r["rows"]
        a, b = "int8", "bf16"
        if a in rows and b in rows:
            same = sum(x == y for x, y in zip(rows[a]["tokens"], rows[b]["tokens"], strict=True))
            print(
                f"\n{r['name']}: int8 and bf16 weights give the same greedy text on {same}/{r['prompts']} prompts"
            )


if __name__ == "__main__":
    sys.exit(main())
