"""The `pagedserve` command line: models, generate, chat, dataplane, controlplane, serve, client,
doctor, bench.

Subcommands import their heavy modules lazily: `pagedserve controlplane`, `client`, `doctor`
and `bench --help` never import torch.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from dataplane.config import ATTENTION_BACKENDS, DEFAULT_MODEL, KV_CACHE_DTYPES

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


ENGINE_GROUP_TITLE = "engine"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named like vLLM's."""
    g = parser.add_argument_group(ENGINE_GROUP_TITLE)
    g.add_argument("--model", default=DEFAULT_MODEL, help="store name or local Hugging Face folder")
    g.add_argument(
        "--model-home", default=None, help="model store directory (default $PAGEDSERVE_MODEL_HOME)"
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=2 * 2**30, help="KV pool size on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="pin the KV pool's block count")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached prompt blocks",
    )
    g.add_argument("--prefix-hash-seed", default="pagedserve", help="seed of the chained block hashes")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="KV cache element type: auto (the model dtype) or FP8 (1 byte per element, 2x the blocks of 16-bit)",
    )
    g.add_argument(
        "--calculate-kv-scales",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FP8 cache: calibrate per-layer K/V scales at start-up (else 1.0, with a warning)",
    )
    g.add_argument(
        "--kv-scales-path",
        default=None,
        help="FP8 cache: JSON file of per-layer K/V scales (overrides calibration)",
    )
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=list(ATTENTION_BACKENDS),
        help="attention kernels (default: triton on CUDA, torch on CPU; triton on CPU needs TRITON_INTERPRET=1)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def make_llm(args: argparse.Namespace) -> Any:
    from dataplane import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_hash_seed=args.prefix_hash_seed,
        num_threads=args.threads,
        model_home=args.model_home,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        kv_scales_path=args.kv_scales_path,
        attention_backend=args.attention_backend,
    )


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from dataplane.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            num_threads=args.threads,
            attention_backend=args.attention_backend,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks_override=args.num_gpu_blocks_override,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_hash_seed=args.prefix_hash_seed,
            kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            kv_scales_path=args.kv_scales_path,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
    )


def make_sampling(args: argparse.Namespace) -> Any:
    from dataplane import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        n=args.n,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = make_sampling(args)
    llm = make_llm(args)
    for out in llm.generate(args.prompts, params):
        for completion in out.outputs:
            print(completion.text)
        print(
            f"[{out.finish_reason}; {out.num_prompt_tokens} prompt + {out.num_output_tokens} generated tokens]",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = make_sampling(args)
    llm = make_llm(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("pagedserve chat — empty line or Ctrl-D to quit, /reset to clear history", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    from dataplane.models.cli import add_models_parser

    add_models_parser(sub)

    gen = sub.add_parser("generate", help="generate a completion for each prompt, offline")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model in the terminal (reads stdin)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from benchmarks.cli import add_bench_parser  # torch-free: each benchmark imports torch when it runs
    from clients.python.cli import add_client_parser
    from controlplane.doctor import add_doctor_parser
    from controlplane.main import add_controlplane_parsers
    from dataplane.server.main import add_dataplane_parser

    add_dataplane_parser(sub)
    add_controlplane_parsers(sub)
    add_client_parser(sub)
    add_doctor_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench":
        from benchmarks.cli import SCRIPTS, run_script_module

        if argv[1] in SCRIPTS:  # kernel benchmarks parse their own arguments
            return run_script_module(SCRIPTS[argv[1]][0], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
