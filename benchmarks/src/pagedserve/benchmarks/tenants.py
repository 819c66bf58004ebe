"""`pagedserve bench tenants`: per-tenant fairness under a flood, on a launched `pagedserve serve`.

Two tenants with equal weights (a keys file with `a: KEY` and `b: KEY`), three rounds on the
same server, each after the previous one has drained:

- `a alone`: tenant a sends `--flood` requests at once;
- `a floods, b`: a sends `--flood` at once; once all of it has reached the control plane
  (its /metrics say so) and a's first token has come, and `--b-delay` seconds more, b sends
  `--victim`;
- `a = b`: a and b send `--victim` each, at once (b's reference time to first token).

The three run `--repeat` times in turn, each round with prompts of its own. By default the
benchmark launches `pagedserve serve`; `--in-process` runs both planes on its own event loop
instead. Per round and tenant: requests, p50/p90 time to first token (from each request's
send, pooled over the repeats) and output tokens/s (from the tenant's first send to its last
token; the median of the repeats). What the issue asks: b's p50 TTFT under the flood ≤ 2×
its p50 in `a = b`, and a's tokens/s under the flood ≥ 0.9× `a alone`. `--compare-fifo`
runs the rounds again with `--tenant-dispatch-tokens 0`: every request goes straight to the
data plane, whose scheduler still shares its batch between the tenants (by preempting a
tenant over its share), but the control plane holds nothing back.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.serve_load import percentile
from pagedserve.benchmarks.server_process import start_serve, stop

KEYS = {"a": "bench-key-a", "b": "bench-key-b"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny", help="a model name or folder; `tiny`: a random-weight tiny Llama made here"
    )
    p.add_argument("--flood", type=int, default=200, help="requests tenant a floods with")
    p.add_argument("--victim", type=int, default=10, help="requests tenant b sends")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--b-delay", type=float, default=0.0, help="seconds after a's first token that b sends")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the data plane's batch limit")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of the data plane (default: torch's)"
    )
    p.add_argument("--kv-cache-memory", default="1GiB", help="the data plane's KV pool")
    p.add_argument("--tenant-dispatch-tokens", type=int, default=4096, help="the control plane's setting")
    p.add_argument("--compare-fifo", action="store_true", help="also run with --tenant-dispatch-tokens 0")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run both planes in this process, on the load generator's event loop, instead of "
        "launching `pagedserve serve` (on a small machine the launched server's control plane "
        "and the load generator compete for the cores)",
    )
    p.add_argument("--blocks", type=int, default=4096, help="KV blocks of the data plane with --in-process")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one round may take")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="times each round runs (in turn); TTFTs are pooled, tokens/s is the median",
    )


def _model(args: argparse.Namespace, workdir: Path) -> str:
    if args.model != "tiny":
        return str(args.model)
    from pagedserve.benchmarks.tiny_models import make_tiny_model

    return str(make_tiny_model("llama", workdir / "tiny-llama"))


InProgress = Callable[[], Awaitable[int]]
"""Tenant a's requests the control plane holds now (queued or generating)."""


def _scraped_in_progress(http_url: str) -> InProgress:
    """`InProgress` read from a launched server's /metrics (open without a key)."""

    def read() -> int:
        with urllib.request.urlopen(http_url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith('pagedserve_tenant_requests_in_progress{tenant="a"}'):
                return int(float(line.split()[-1]))
        return 0

    async def in_progress() -> int:
        return await asyncio.to_thread(read)

    return in_progress


def _start(
    args: argparse.Namespace, model: str, keys: Path, pending: int
) -> tuple[subprocess.Popen[str], str, str]:
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", "0", "--http-port", "0"]
    cmd += ["--model", model, "--api-key-file", str(keys), "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--kv-cache-memory", args.kv_cache_memory, "--tenant-dispatch-tokens", str(pending)]
    cmd += ["--max-queue-len", str(4 * (args.flood + args.victim))]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return start_serve(cmd)


async def _send(
    client: Any, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None
) -> tuple[float, float | None, float, int]:
    """(sent, first token, last token, tokens) of one streamed request (perf_counter seconds);
    `started` is set at its first token."""
    from pagedserve.clients.python import StreamChunk

    sent = time.perf_counter()
    first: float | None = None
    last, tokens = sent, 0
    async for item in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if isinstance(item, StreamChunk) and item.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(item.token_ids)
            if started is not None:
                started.set()
    return sent, first, last, tokens


def _figures(repeats: list[list[Any]]) -> dict[str, Any]:
    """One tenant's figures over a round's repeats: TTFT percentiles of every request pooled,
    tokens/s the median of each repeat's (its tokens over its first send to its last token)."""
    results = [r for repeat in repeats for r in repeat]
    done = [r for r in results if not isinstance(r, BaseException) and r[1] is not None]
    errors = sorted({f"{type(r).__name__}: {r}"[:120] for r in results if isinstance(r, BaseException)})
    ttft = [first - sent for sent, first, _, _ in done if first is not None]
    rates = []
    for repeat in repeats:
        ok = [r for r in repeat if not isinstance(r, BaseException) and r[1] is not None]
        span = max((r[2] for r in ok), default=0.0) - min((r[0] for r in ok), default=0.0)
        rates.append(sum(r[3] for r in ok) / span if span > 0 else 0.0)
    return {
        "requests": len(results),
        "completed": len(done),
        "errors": errors[:3],
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p90_ms": 1000 * percentile(ttft, 90),
        "tokens": sum(r[3] for r in done),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_each": rates,
    }


_rounds_run = itertools.count()


async def _round(
    args: argparse.Namespace, address: str, a_count: int, b_count: int, a_in: InProgress | None
) -> dict[str, list[Any]]:
    """a sends `a_count`, b `b_count`: at once, or (with `a_in`) once all of a's requests
    have reached the control plane (calls are picked up one at a time) and a's first token
    has come. Each round's prompts are its own: no round hits another's prefix cache."""
    import random

    from pagedserve.clients.python import AsyncGenerationClient
    from pagedserve.clients.python.retry import NO_RETRY

    rng = random.Random(next(_rounds_run))

    def prompt() -> list[int]:
        return [rng.randrange(10, 300) for _ in range(args.input_len)]

    async with (
        AsyncGenerationClient(address, api_key=KEYS["a"], retry=NO_RETRY) as a,
        AsyncGenerationClient(address, api_key=KEYS["b"], retry=NO_RETRY) as b,
    ):
        for client in (a, b):  # warm-up (and a check that both keys work)
            await client.generate(prompt()[:8], max_tokens=2, temperature=0.0, ignore_eos=True)
        started = asyncio.Event()
        a_tasks = [
            asyncio.ensure_future(_send(a, prompt(), args.output_len, started)) for _ in range(a_count)
        ]
        if a_in is not None:
            await asyncio.wait_for(started.wait(), args.timeout)
            while await a_in() + sum(t.done() for t in a_tasks) < a_count:
                await asyncio.sleep(0.01)
            await asyncio.sleep(args.b_delay)
        b_tasks = [asyncio.ensure_future(_send(b, prompt(), args.output_len)) for _ in range(b_count)]
        a_results = await asyncio.wait_for(asyncio.gather(*a_tasks, return_exceptions=True), args.timeout)
        b_results = await asyncio.wait_for(asyncio.gather(*b_tasks, return_exceptions=True), args.timeout)
    out = {"a": list(a_results)}
    if b_count:
        out["b"] = list(b_results)
    return out


async def _rounds(args: argparse.Namespace, address: str, a_in: InProgress) -> dict[str, Any]:
    """The three rounds `--repeat` times, in turn (so drifts of a noisy machine spread over all
    three), after an untimed one: a first batch of every size pays one-off costs (allocations,
    kernel choices) that would otherwise land on whichever round comes first."""
    await _round(args, address, args.flood, args.victim, None)
    plan = {
        "a alone": (args.flood, 0, None),
        "a floods, b": (args.flood, args.victim, a_in),
        "a = b": (args.victim, args.victim, None),
    }
    runs: dict[str, list[dict[str, list[Any]]]] = {name: [] for name in plan}
    for _ in range(args.repeat):
        for name, (a_count, b_count, waits) in plan.items():
            runs[name].append(await _round(args, address, a_count, b_count, waits))
    return {
        name: {tenant: _figures([r[tenant] for r in repeats]) for tenant in repeats[0]}
        for name, repeats in runs.items()
    }


async def _in_process_rounds(
    args: argparse.Namespace, model: str, keys: Path, pending: int
) -> dict[str, Any]:
    """Both planes on this event loop (as tests/e2e/harness.py runs them): no separate
    processes competing with the load generator for the cores."""
    from pagedserve.controlplane.config import ControlPlaneConfig
    from pagedserve.controlplane.server import start_control_plane
    from pagedserve.controlplane.tenancy.auth import load_keys, load_tenant_settings
    from pagedserve.dataplane.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pagedserve.dataplane.server.server import build_engine_loop, create_server

    engine = EngineConfig(
        model=ModelConfig(model=model, num_threads=args.threads),
        cache=CacheConfig(num_gpu_blocks_override=args.blocks, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
    )
    loop = build_engine_loop(engine, dataplane_id="bench")
    server, port = await create_server(loop, "127.0.0.1:0")
    api_keys, tenants = load_keys((), keys)
    config = ControlPlaneConfig(
        model=model,
        dataplanes=(f"127.0.0.1:{port}",),
        api_keys=api_keys,
        api_key_tenants=tenants,
        tenant_settings=load_tenant_settings(keys),
        tenant_dispatch_tokens=pending,
        max_queue_len=4 * (args.flood + args.victim),
    )
    cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
    try:
        assert await cp.dispatcher.wait_ready(60.0), "the data plane did not connect"

        async def a_in() -> int:
            return cp.dispatcher.tenants.in_progress.get("a", 0)

        return await _rounds(args, f"127.0.0.1:{cp.grpc_port}", a_in)
    finally:
        await cp.stop()
        await server.stop(0)
        loop.stop()


def _verdict(rounds: dict[str, Any]) -> dict[str, float]:
    flood, alone, equal = rounds["a floods, b"], rounds["a alone"], rounds["a = b"]
    return {
        "b_ttft_p50_flood_over_equal": flood["b"]["ttft_p50_ms"] / max(1e-9, equal["b"]["ttft_p50_ms"]),
        "a_tokens_per_s_flood_over_alone": flood["a"]["tokens_per_s"] / max(1e-9, alone["a"]["tokens_per_s"]),
    }


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "out")}}
    modes = [("fair", args.tenant_dispatch_tokens)] + ([("no dispatch cap", 0)] if args.compare_fifo else [])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        keys = workdir / "keys"
        keys.write_text("".join(f"{tenant}: {key}\n" for tenant, key in KEYS.items()))
        model = _model(args, workdir)
        for mode, pending in modes:
            if args.in_process:
                rounds = asyncio.run(_in_process_rounds(args, model, keys, pending))
            else:
                proc, address, http_url = _start(args, model, keys, pending)
                try:
                    rounds = asyncio.run(_rounds(args, address, _scraped_in_progress(http_url)))
                finally:
                    stop(proc)
            rows = [
                [
                    name,
                    tenant,
                    f"{f['completed']}/{f['requests']}",
                    f"{f['ttft_p50_ms']:.0f}",
                    f"{f['ttft_p90_ms']:.0f}",
                    f"{f['tokens_per_s']:.1f}",
                ]
                for name, per in rounds.items()
                for tenant, f in per.items()
            ]
            verdict = _verdict(rounds)
            notes = [
                f"b's p50 TTFT under a's flood = {verdict['b_ttft_p50_flood_over_equal']:.2f}× its p50 "
                "with a sending as many (≤ 2 asked)",
                f"a's tok/s under the flood = {verdict['a_tokens_per_s_flood_over_alone']:.2f}× a alone "
                "(≥ 0.9 asked)",
            ]
            report.table(
                f"tenants, {mode} (--tenant-dispatch-tokens {pending})",
                ["round", "tenant", "done", "TTFT p50 ms", "TTFT p90 ms", "tok/s"],
                rows,
                notes,
            )
            results[mode] = {"rounds": rounds, **verdict}
    return results
