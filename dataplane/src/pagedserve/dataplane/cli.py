"""The data plane's subcommands: `generate` and `chat` (the engine in process) and `dataplane`
(the engine behind its gRPC service). The product shell (src/pagedserve/cli.py) mounts them.

Heavy modules are imported when a command runs, so `--help` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedserve.common import settings
from pagedserve.common.lifecycle import cli_command, exit_with_parent
from pagedserve.common.log_format import LoggingConfig
from pagedserve.dataplane.config import DataPlaneConfig, add_engine_args, engine_config_from_args

# --help shows every default (settings declare theirs once, in dataplane/src/pagedserve/dataplane/config.py).
HELP_FORMAT = settings.HelpFormatter


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best")
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of this request's sampling (default: unseeded)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def make_llm(args: argparse.Namespace) -> Any:
    from pagedserve.dataplane import LLM

    return LLM.from_config(engine_config_from_args(args))


def make_sampling(args: argparse.Namespace) -> Any:
    from pagedserve.dataplane import SamplingParams

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


@cli_command
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


@cli_command
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


def add_dataplane_parsers(sub: Any) -> None:
    """`generate`, `chat` and `dataplane` on the root parser's subcommands."""
    gen = sub.add_parser(
        "generate", help="generate a completion for each prompt, offline", formatter_class=HELP_FORMAT
    )
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat", help="chat with the model in the terminal (reads stdin)", formatter_class=HELP_FORMAT
    )
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    dp = sub.add_parser(
        "dataplane",
        help="run a data plane: the KV block pool, scheduler and model, over gRPC",
        formatter_class=HELP_FORMAT,
    )
    settings.add_arguments(dp, DataPlaneConfig, title="data plane")
    settings.add_arguments(dp, LoggingConfig, title="logging")
    dp.add_argument(
        "--config-json",
        default=None,
        help="the whole DataPlaneConfig as JSON (what `pagedserve serve` hands its child); "
        "replaces every other data-plane and engine flag (default: none, built from the flags)",
    )
    dp.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help=argparse.SUPPRESS)
    dp.set_defaults(func=cmd_dataplane)


def dataplane_config_from_args(args: argparse.Namespace) -> DataPlaneConfig:
    if args.config_json is not None:
        return settings.from_json(DataPlaneConfig, args.config_json)
    return settings.from_arguments(DataPlaneConfig, args)


@cli_command
def cmd_dataplane(args: argparse.Namespace) -> int:
    from pagedserve.dataplane.server.openmp import set_spin_count

    if args.exit_with_parent is not None:  # `serve`'s child: SIGTERM when `serve` dies
        exit_with_parent(args.exit_with_parent)
    config = dataplane_config_from_args(args)
    set_spin_count(config.omp_spin_count)  # before torch (and its libgomp) is loaded

    from pagedserve.common.telemetry import configure_tracing
    from pagedserve.common.tls import read_token_file, server_tls
    from pagedserve.dataplane.server.server import run

    tls = server_tls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    token = read_token_file(config.dataplane_token_file) if config.dataplane_token_file else None
    configure_tracing("pagedserve-dataplane")
    return run(config, tls, token)
