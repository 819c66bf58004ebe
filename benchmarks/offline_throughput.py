"""Kept for old commands: `python -m benchmarks.offline_throughput` = `pagedserve bench throughput`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main())
