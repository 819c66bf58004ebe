"""What every `pagedserve bench` subcommand produces: a printed table, a JSON file, a PNG plot.

A `Report` is handed to a subcommand's `run(args, report)`. The subcommand prints its tables
through it, iterates its long loops through `report.progress` (a tqdm bar on stderr), draws
into `report.figure()` and returns a JSON-ready dict; the report then writes
`<out>/<name>.json` (that dict plus the command, time, host and tables) and `<out>/<name>.png`.
Without `--out`, `<out>` is a fresh `./pagedserve-bench-results/<name>-<timestamp>/`
(`default_out_dir`): a run never overwrites an earlier one, nor the committed figures in
`benchmarks/results/` (refreshed only with `--out benchmarks/results`).
matplotlib is imported only when a figure is asked for, and a missing matplotlib skips the plot
with a warning instead of failing the benchmark. Imports no torch.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pagedserve.benchmarks.common import load_note

T = TypeVar("T")
# How to get matplotlib, as the README installs the package (from a checkout, editable): the
# `bench` extra of pyproject.toml (`make install` installs it too).
PLOT_EXTRA_HINT = 'from the checkout: .venv/bin/pip install -e ".[bench]"'
RESULTS_ROOT = Path("pagedserve-bench-results")
"""Where runs go without `--out` (relative to the current directory), one fresh folder each."""


def default_out_dir(name: str, root: Path | None = None) -> Path:
    """A folder no earlier run used: `<root>/<name>-<YYYYmmdd-HHMMSS>` (with `-2`, `-3`, ...
    when that exists already); `root` defaults to RESULTS_ROOT."""
    base = (RESULTS_ROOT if root is None else root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, i = base, 1
    while out.exists():
        i += 1
        out = base.with_name(f"{base.name}-{i}")
    return out


def fmt_pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table, columns padded so it also reads as plain text."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


class Report:
    def __init__(
        self, name: str, out_dir: Path | None, command: Sequence[str], progress: bool = True
    ) -> None:
        self.name = name
        self.out_dir = out_dir
        self.command = " ".join(command)
        self.show_progress = progress
        self.tables: list[dict[str, Any]] = []
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.loads = {"start": load_note()}
        self.png_path: Path | None = None

    @property
    def json_path(self) -> Path | None:
        return self.out_dir / f"{self.name}.json" if self.out_dir else None

    def progress(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
        """`items`, with a progress bar on stderr (unless progress is off)."""
        from tqdm import tqdm

        bar: Iterable[T] = tqdm(
            items, desc=desc, total=total, disable=not self.show_progress, file=sys.stderr, leave=False
        )
        return bar

    def bar(self, total: int, desc: str) -> Any:
        """A progress bar to `update(n)` by hand (close it when done)."""
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=not self.show_progress, file=sys.stderr, leave=False)

    def table(
        self, title: str, header: Sequence[str], rows: Sequence[Sequence[str]], notes: Sequence[str] = ()
    ) -> None:
        print(f"\n## {title}\n")
        print(format_table(header, rows))
        for note in notes:
            print(f"\n- {note}" if note is notes[0] else f"- {note}")
        print(flush=True)
        self.tables.append(
            {"title": title, "header": list(header), "rows": [list(r) for r in rows], "notes": list(notes)}
        )

    def figure(self, ncols: int = 1, width: float = 7.0, height: float = 4.5) -> Any:
        """A matplotlib Figure with `ncols` axes side by side, or None without matplotlib or output dir."""
        if self.out_dir is None:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(
                f"warning: matplotlib is not installed ({PLOT_EXTRA_HINT}); no plot",
                file=sys.stderr,
            )
            return None
        fig, _ = plt.subplots(1, ncols, figsize=(width, height))
        return fig

    def save_figure(self, fig: Any) -> None:
        import matplotlib.pyplot as plt

        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.png_path = self.out_dir / f"{self.name}.png"
        fig.suptitle(f"pagedserve bench {self.name}", fontsize=10)
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=110)
        plt.close(fig)

    def finish(self, results: dict[str, Any]) -> None:
        """Write the JSON file and say where everything went."""
        self.loads["end"] = load_note()
        doc = {
            "benchmark": self.name,
            "command": self.command,
            "time": self.started,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": self.loads},
            "tables": self.tables,
            **results,
        }
        if self.json_path is None:
            return
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        wrote = [str(self.json_path), *([str(self.png_path)] if self.png_path else [])]
        print(f"wrote {', '.join(wrote)}", file=sys.stderr)
