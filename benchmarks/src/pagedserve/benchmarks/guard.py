"""`pagedserve bench guard`: does one client's heavy or hostile input stall everyone else?

Launches `pagedserve serve` (its data-plane link token in a file, so the raw cases can use
the data-plane port like a stray local process would) and runs a guard stream: greedy
requests of `--guard-tokens` tokens, one after another, over the public gRPC API. Per case
(pagedserve/benchmarks/guard_cases.py, in a process of its own, prepared before the clock
starts), the guard's inter-token gaps while the case ran: median, longest, and their ratio
(the target: the longest at most 3x the median). Every guard request must give the same
tokens (greedy, the same prompt): a case that changed another client's output fails the run.

    pagedserve bench guard --threads 2 --cases halfclose killcp -- --prefill-stretch 1
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.guard_cases import CASES
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.server_process import start_serve, stop
from pagedserve.clients.python.client import GenerationClient, StreamChunk
from pagedserve.common.lifecycle import free_port
from pagedserve.common.models import DEFAULT_MODEL

TARGET_RATIO = 3.0
# Token ids, not text: any model serves them, a tiny random-weight one (no tokenizer) included.
GUARD_PROMPT = [3 + (13 * k) % 300 for k in range(24)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="the served model, a name or folder (default: serve's default model)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of the data plane (default: torch's)"
    )
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run, in order")
    p.add_argument("--rounds", type=int, default=3, help="times each case runs (burst: once)")
    p.add_argument("--guard-tokens", type=int, default=64, help="tokens of each guard request")
    p.add_argument("--settle", type=float, default=4.0, help="seconds the guard runs alone before a case")
    p.add_argument(
        "serve_args",
        nargs="*",
        help="more `pagedserve serve` flags, after `--` (e.g. -- --prefill-stretch 1)",
    )


def _start(
    args: argparse.Namespace, token_file: Path, dataplane_port: int
) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", "0", "--http-port", "0"]
    cmd += ["--dataplane-port", str(dataplane_port), "--dataplane-token-file", str(token_file)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc, address, _ = start_serve(cmd + list(args.serve_args))
    return proc, address


class Guard:
    """Greedy requests one after another; each token's arrival time, per request."""

    def __init__(self, address: str, max_tokens: int) -> None:
        self.client = GenerationClient(address, timeout=600)
        self.max_tokens = max_tokens
        self.stamps: list[tuple[float, int]] = []  # (time, request number)
        self.outputs: list[list[int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        k = 0
        try:
            while not self._stop.is_set():
                tokens: list[int] = []
                for item in self.client.generate_stream(
                    GUARD_PROMPT, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True
                ):
                    if isinstance(item, StreamChunk):
                        self.stamps.append((time.monotonic(), k))
                        tokens += item.token_ids
                self.outputs.append(tokens)
                k += 1
        except BaseException as exc:  # reported with the figures
            self.error = exc

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens of one request, starting within [start, end]."""
        pairs = zip(self.stamps, self.stamps[1:], strict=False)
        return [b[0] - a[0] for a, b in pairs if a[1] == b[1] and start <= a[0] <= end]


def _case(
    guard: Guard, case: str, rounds: int, address: str, dataplane: str, token_file: Path, model: str
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pagedserve.benchmarks.guard_cases", case, address, dataplane]
    cmd += [str(token_file), model, str(1 if case == "burst" else rounds)]
    hostile = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hostile.stdin is not None and hostile.stdout is not None
    first = hostile.stdout.readline().strip()
    if first != "ready":
        raise RuntimeError(f"case {case} did not start (exit {hostile.wait()}): {first!r}")
    time.sleep(1.0)
    start = time.monotonic()
    hostile.stdin.write("go\n")
    hostile.stdin.flush()
    lines = [line.strip() for line in hostile.stdout]
    code = hostile.wait()
    end = time.monotonic()
    if code != 0:
        raise RuntimeError(f"case {case} exited with {code}: {lines[-3:]}")
    time.sleep(1.0)  # the guard's gaps that started in the case end after it
    gaps = guard.gaps(start, end)
    median, longest = statistics.median(gaps), max(gaps)
    return {
        "case": case,
        "seconds": end - start,
        "gaps": len(gaps),
        "median_gap_ms": median * 1000,
        "longest_gap_ms": longest * 1000,
        "ratio": longest / median,
        "rounds": lines,
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "out")}}
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "dataplane-token"
        token_file.write_text(secrets.token_hex(32) + "\n")
        token_file.chmod(0o600)
        dataplane_port = free_port()
        proc, address = _start(args, token_file, dataplane_port)
        guard: Guard | None = None
        try:
            guard = Guard(address, args.guard_tokens)
            guard.start()
            cases = []
            for case in args.cases:
                time.sleep(args.settle)
                dataplane = f"127.0.0.1:{dataplane_port}"
                cases.append(
                    _case(
                        guard, case, args.rounds, address, dataplane, token_file, args.model or DEFAULT_MODEL
                    )
                )
                if guard.error is not None:
                    raise RuntimeError(f"the guard stream failed during {case}: {guard.error!r}")
        finally:
            if guard is not None:
                guard.stop()
            stop(proc)
    assert guard is not None
    outputs = guard.outputs
    identical = sum(out == outputs[0] for out in outputs)
    rows = [
        [
            c["case"],
            f"{c['seconds']:.1f}",
            str(c["gaps"]),
            f"{c['median_gap_ms']:.0f}",
            f"{c['longest_gap_ms']:.0f}",
            f"{c['ratio']:.1f}x",
            "yes" if c["ratio"] <= TARGET_RATIO else "no",
        ]
        for c in cases
    ]
    notes = [f"guard requests with the first one's tokens: {identical}/{len(outputs)}"]
    notes += [f"{c['case']}: {'; '.join(c['rounds'])}" for c in cases]
    report.table(
        "guard stream while each case ran",
        ["case", "s", "gaps", "median ms", "longest ms", "longest / median", f"≤ {TARGET_RATIO:g}x"],
        rows,
        notes,
    )
    results.update(cases=cases, guard_requests=len(outputs), guard_identical=identical)
    return results
