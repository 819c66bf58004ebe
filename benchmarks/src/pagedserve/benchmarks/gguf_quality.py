"""Quantized-weight quality: perplexity of the default model's weights written as GGUF files of
several types and served quantized, against the fp32 model.

    pagedserve bench gguf-quality [--types Q8_0,Q4_K,Q4_0] [--max-ppl-tokens N] [--json out.json]

Each file is made from the fp32 model's weights (benchmarks/src/pagedserve/benchmarks/gguf_write.py, the metadata of the
default model's own Q4_1 file; K-quant files keep rows that are not whole 256-weight
super-blocks in Q8_0) under the store's `.gguf-bench/`, reused while the weights are unchanged.
The default model's own Q4_1 file is measured as it is. Perplexity: the passages text
(benchmarks/src/pagedserve/benchmarks/data), prefilled in chunks through each engine's paged cache; the fp32 row is the
reference ("Δ ppl").
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import cpu_line, phase
from pagedserve.common.settings import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pagedserve bench gguf-quality", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the fp32 model (store name)")
    parser.add_argument(
        "--gguf",
        default="SmolLM2-135M-Instruct-Q4_1",
        help="its own GGUF file (store name): metadata and a row",
    )
    parser.add_argument("--types", default="Q8_0,Q4_K,Q4_0", help="GGUF types to write and measure")
    parser.add_argument("--max-ppl-tokens", type=int, default=2048, help="truncate the perplexity text")
    parser.add_argument("--chunk", type=int, default=512, help="perplexity prefill chunk, tokens")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures here (default: none, print only)"
    )
    return parser


def engine_perplexity(model: str, ids: list[int], chunk: int) -> float:
    from pagedserve.benchmarks.fp8_quality import perplexity
    from pagedserve.dataplane import LLM

    llm = LLM(model, kv_cache_memory=512 << 20, max_model_len=max(len(ids) + 16, 256))
    return perplexity(llm, ids, chunk)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from safetensors.torch import load_file

    from pagedserve.benchmarks.gguf_write import write_gguf_like
    from pagedserve.benchmarks.workloads import PASSAGES_FILE
    from pagedserve.common.models import resolve_model_path, store_dir
    from pagedserve.common.models.gguf_folder import gguf_weights_file
    from pagedserve.dataplane.runner.model_loader import load_tokenizer

    fp32_folder = resolve_model_path(args.model)
    template = gguf_weights_file(resolve_model_path(args.gguf))
    if template is None:
        print(f"{args.gguf} is not a GGUF model", file=sys.stderr)
        return 1
    tokenizer = load_tokenizer(fp32_folder)
    assert tokenizer is not None, "the perplexity text needs the model's tokenizer"
    ids: list[int] = tokenizer.encode(PASSAGES_FILE.read_text(), add_special_tokens=False)[
        : args.max_ppl_tokens
    ]
    print(cpu_line())
    rows: dict[str, Any] = {"fp32": phase("fp32", lambda: engine_perplexity(args.model, ids, args.chunk))}
    rows[f"{args.gguf} (file)"] = phase(args.gguf, lambda: engine_perplexity(args.gguf, ids, args.chunk))
    weights = load_file(fp32_folder / "model.safetensors")
    out_dir = store_dir() / ".gguf-bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = int((fp32_folder / "model.safetensors").stat().st_mtime)
    for type_name in args.types.split(","):
        path = out_dir / f"{fp32_folder.name}-{type_name}-{stamp}.gguf"
        if not path.is_file():
            phase(f"write {path.name}", partial(write_gguf_like, template, weights, path, type_name))
        rows[type_name] = phase(type_name, partial(engine_perplexity, str(path), ids, args.chunk))
    base = rows["fp32"]
    print(f"perplexity on {len(ids)} tokens of {PASSAGES_FILE.name}")
    print("| weights | perplexity | Δ ppl |")
    print("|---|---|---|")
    for name, ppl in rows.items():
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |")
    if args.json:
        args.json.write_text(
            json.dumps({"cpu": cpu_line(), "tokens": len(ids), "perplexity": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
