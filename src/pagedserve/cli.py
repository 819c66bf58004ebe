"""The `pagedserve` command: the product shell over both planes.

Each plane owns its subcommands (dataplane/src/pagedserve/dataplane/cli.py: generate, chat, dataplane;
controlplane/src/pagedserve/controlplane/cli.py: controlplane; controlplane/src/pagedserve/controlplane/doctor.py: doctor); this module mounts them
with `models`, `serve`, `client` and `bench`. Nothing below imports this package's shell
modules. Subcommands import their heavy modules when they run: `pagedserve controlplane`,
`client`, `doctor` and every `--help` stay free of torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedserve.common.settings import ArgumentParser
from pagedserve.common.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.benchmarks.cli import add_bench_parser
    from pagedserve.clients.python.cli import add_client_parser
    from pagedserve.controlplane.cli import add_controlplane_parser
    from pagedserve.controlplane.doctor import add_doctor_parser
    from pagedserve.dataplane.cli import add_dataplane_parsers
    from pagedserve.kernels_cli import add_kernels_parser
    from pagedserve.models_cli import add_models_parser
    from pagedserve.serve import add_serve_parser

    # Subparsers take the parser's class, so every subcommand shows its defaults (settings.HelpFormatter).
    parser = ArgumentParser(prog="pagedserve", description="LLM inference on a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_models_parser(sub)
    add_kernels_parser(sub)
    add_dataplane_parsers(sub)
    add_controlplane_parser(sub)
    add_serve_parser(sub)
    add_client_parser(sub)
    add_doctor_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench":
        from pagedserve.benchmarks.cli import SCRIPTS, run_script_module

        if argv[1] in SCRIPTS:  # kernel benchmarks parse their own arguments
            return run_script_module(SCRIPTS[argv[1]][0], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "log_format"):  # a server command: its --log-format, else the parent's
            from pagedserve.common import env
            from pagedserve.common.log import use_log_format

            use_log_format(args.log_format or env.log_format())
        result: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1
    return result
