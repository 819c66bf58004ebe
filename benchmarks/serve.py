"""`pagedserve bench serve`: online load against a running server, over gRPC or the OpenAI API.

    pagedserve serve &                                            # in another terminal
    pagedserve bench serve --address 127.0.0.1:50051 --request-rate 4 --num-prompts 64
    pagedserve bench serve --api openai --address http://127.0.0.1:8000 --concurrency 16

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once), or
with `--concurrency` C a closed loop keeps exactly C in flight. The run is bounded by
`--num-prompts` and `--max-duration` (requests not started by then are not sent; those in
flight are cancelled and counted as unfinished). Prompts are token ids (the chat workload
built with the model's tokenizer, or `--workload random` for models without one), greedy,
`ignore_eos`, one output length per request spread over [`--min-output`, `--max-output`].

Per request the client records when each token arrives: time to first token (TTFT), time per
output token after the first (TPOT), every inter-token gap (ITL) and end-to-end latency.
Reported: completed/failed requests, output tokens/s, requests/s, p50/p90/p99 of each
latency, and goodput: completed requests per second that met both `--ttft-slo` and
`--tpot-slo` (ms). The PNG shows the latency CDFs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Report, fmt_pct
from benchmarks.workloads import output_lengths


@dataclass
class Outcome:
    prompt_tokens: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    finished: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", choices=["grpc", "openai"], default="grpc")
    p.add_argument(
        "--address",
        default=None,
        help="gRPC HOST:PORT (default 127.0.0.1:50051) or http://HOST:PORT (openai)",
    )
    p.add_argument("--model", default=None, help="model name to send (openai; default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=["chat", "random"], default="chat")
    p.add_argument("--tokenizer", default=None, help="model folder or store name for the chat workload")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the random workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument(
        "--concurrency", type=int, default=None, help="closed loop with this many requests in flight"
    )
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds; later requests are not sent")
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="goodput target for TTFT, ms")
    p.add_argument("--tpot-slo", type=float, default=200.0, help="goodput target for TPOT, ms")
    p.add_argument("--seed", type=int, default=0)


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    if args.workload == "random":
        rng = random.Random(args.seed)
        return [[rng.randrange(10, 300) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    from transformers import AutoTokenizer

    from benchmarks.workloads import chat_prompts
    from pagedserve.common.models import DEFAULT_MODEL, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer or DEFAULT_MODEL))
    return chat_prompts(tokenizer, n=args.num_prompts, seed=args.seed)


class _GrpcTarget:
    def __init__(self, address: str, api_key: str | None) -> None:
        from clients.python import AsyncGenerationClient
        from clients.python.client import NO_RETRY

        # No client retries: a refused request counts as refused (the HTTP target does not retry).
        self.client = AsyncGenerationClient(address, api_key=api_key, retry=NO_RETRY)

    async def run(self, prompt: list[int], max_tokens: int, outcome: Outcome) -> None:
        from clients.python import Completion

        async for item in self.client.generate_stream(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            if isinstance(item, Completion):
                outcome.finished = True
            elif item.token_ids:
                now = time.perf_counter()
                outcome.token_times.extend([now] * len(item.token_ids))

    async def close(self) -> None:
        await self.client.close()


class _OpenAITarget:
    """Raw SSE over HTTP/1.1 with asyncio streams (no HTTP client dependency in the loop)."""

    def __init__(self, url: str, model: str | None, api_key: str | None) -> None:
        rest = url.removeprefix("http://").rstrip("/")
        host, _, port = rest.partition(":")
        self.host, self.port = host, int(port or 80)
        self.model = model
        self.api_key = api_key

    async def _model(self) -> str:
        if self.model is None:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self._request("GET", "/v1/models", b""))
            data = await reader.read()
            writer.close()
            self.model = json.loads(data.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]
        return self.model

    def _request(self, method: str, path: str, body: bytes) -> bytes:
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body

    async def run(self, prompt: list[int], max_tokens: int, outcome: Outcome) -> None:
        body = {
            "model": await self._model(),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(self._request("POST", "/v1/completions", json.dumps(body).encode()))
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(status.decode().strip())
            async for raw in reader:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    outcome.finished = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                # One chunk per token delta (its text may be empty mid-character); the last
                # chunk of a choice only carries its finish_reason.
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    outcome.token_times.append(time.perf_counter())
        finally:
            writer.close()

    async def close(self) -> None:
        pass


async def _drive(
    args: argparse.Namespace, prompts: list[list[int]], lengths: list[int], report: Report
) -> tuple[list[Outcome], float]:
    target: Any
    if args.api == "grpc":
        target = _GrpcTarget(args.address or "127.0.0.1:50051", args.api_key)
    else:
        target = _OpenAITarget(args.address or "http://127.0.0.1:8000", args.model, args.api_key)
    outcomes: list[Outcome] = []
    bar = report.bar(len(prompts), "requests")
    rng = random.Random(args.seed + 1)
    start = time.perf_counter()
    deadline = start + args.max_duration

    async def one(i: int) -> None:
        outcome = Outcome(len(prompts[i]), time.perf_counter())
        outcomes.append(outcome)
        try:
            await asyncio.wait_for(
                target.run(prompts[i], lengths[i], outcome), max(0.0, deadline - time.perf_counter())
            )
        except TimeoutError:
            outcome.error = "max-duration reached"
        except Exception as exc:  # a failed request is a result, not a crash
            outcome.error = f"{type(exc).__name__}: {exc}"
        bar.update(1)

    try:
        if args.concurrency:
            queue = list(range(len(prompts)))

            async def worker() -> None:
                while queue and time.perf_counter() < deadline:
                    await one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            tasks = []
            for i in range(len(prompts)):
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(one(i)))
                if math.isfinite(args.request_rate):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
    finally:
        bar.close()
        await target.close()
    return outcomes, time.perf_counter() - start


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    if args.num_prompts < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ValueError("--num-prompts and --concurrency must be >= 1")
    prompts = _prompts(args)
    lengths = output_lengths(len(prompts), args.min_output, args.max_output, seed=args.seed)
    outcomes, wall = asyncio.run(_drive(args, prompts, lengths, report))
    done = [o for o in outcomes if o.finished and o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    tokens = sum(len(o.token_times) for o in outcomes)
    ttft = [o.ttft for o in done if o.ttft is not None]
    tpot = [o.tpot for o in done if o.tpot is not None]
    e2e = [o.e2e for o in done if o.e2e is not None]
    itl = [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    good = [
        o
        for o in done
        if (o.ttft or 0) * 1000 <= args.ttft_slo and (o.tpot is None or o.tpot * 1000 <= args.tpot_slo)
    ]
    mode = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.request_rate:g}/s"
    report.table(
        f"serve ({args.api}, {mode})",
        [
            "requests",
            "failed",
            "duration s",
            "output tok/s",
            "req/s",
            f"goodput req/s (TTFT<={args.ttft_slo:g}ms, TPOT<={args.tpot_slo:g}ms)",
        ],
        [
            [
                f"{len(done)}/{len(outcomes)}",
                str(len(failed)),
                f"{wall:.1f}",
                f"{tokens / wall:.1f}",
                f"{len(done) / wall:.2f}",
                f"{len(good) / wall:.2f} ({fmt_pct(len(good) / max(1, len(done)))})",
            ]
        ],
        notes=sorted({o.error for o in failed if o.error})[:3],
    )
    rows = []
    stats: dict[str, dict[str, float]] = {}
    for name, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        q = {f"p{p}": percentile(values, p) * 1000 for p in (50, 90, 99)}
        stats[name] = {**q, "mean": 1000 * sum(values) / len(values) if values else math.nan}
        rows.append([name, *(f"{q[f'p{p}']:.1f}" for p in (50, 90, 99)), f"{stats[name]['mean']:.1f}"])
    report.table("latency, ms", ["metric", "p50", "p90", "p99", "mean"], rows)
    fig = report.figure(ncols=2, width=10)
    if fig is not None:
        for ax, (name, values) in zip(fig.axes, (("TTFT", ttft), ("ITL", itl)), strict=True):
            xs = sorted(v * 1000 for v in values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
            ax.set_xlabel(f"{name}, ms")
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
        report.save_figure(fig)
    return {
        "api": args.api,
        "mode": mode,
        "completed": len(done),
        "failed": len(failed),
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(done) / wall,
        "goodput_requests_per_s": len(good) / wall,
        "latency_ms": stats,
    }


if __name__ == "__main__":
    from benchmarks.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
