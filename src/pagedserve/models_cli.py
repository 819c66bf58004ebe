"""`pagedserve models pull [NAME]` and `pagedserve models list`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedserve.common.env import MODEL_HOME_HELP
from pagedserve.common.models.store import DEFAULT_MODEL


def _cmd_pull(args: argparse.Namespace) -> int:
    from pagedserve.common.models.store import ModelNotFoundError, PullError, pull_model

    try:
        path = pull_model(args.name, store=args.model_home, force=args.force, progress=not args.quiet)
    except (ModelNotFoundError, PullError, OSError) as exc:
        print(f"pagedserve models pull: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedserve models pull: interrupted; nothing was left in the store", file=sys.stderr)
        return 130
    print(path)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from pagedserve.common.models.store import list_models

    try:
        rows = list_models(store=args.model_home)
    except OSError as exc:
        print(f"pagedserve models list: error: {exc}", file=sys.stderr)
        return 1
    table = [("NAME", "PULLED", "SIZE_MB", "PATH")]
    for row in rows:
        size = f"{row.size_bytes / 1e6:.1f}" if row.size_bytes else "-"
        table.append((row.name, "yes" if row.pulled else "no", size, str(row.path)))
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    return 0


def add_models_parser(subparsers: Any) -> None:
    """Add the `models` command (subcommands `pull`, `list`) to an argparse subparsers object."""
    models = subparsers.add_parser("models", help="manage the local model store")
    msub = models.add_subparsers(dest="models_command", required=True)

    pull = msub.add_parser("pull", help="download and convert a model into the local store")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, help="model name")
    pull.add_argument("--model-home", default=None, metavar="DIR", help=MODEL_HOME_HELP)
    pull.add_argument("--force", action="store_true", help="re-download and re-convert even if present")
    pull.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bars (the conversion's included); errors still print",
    )
    pull.set_defaults(func=_cmd_pull)

    lst = msub.add_parser("list", help="list known and pulled models")
    lst.add_argument("--model-home", default=None, metavar="DIR", help=MODEL_HOME_HELP)
    lst.set_defaults(func=_cmd_list)
