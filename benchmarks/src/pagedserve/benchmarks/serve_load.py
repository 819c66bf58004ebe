"""The load generator behind `pagedserve bench serve`: send a workload to a server over gRPC or
the OpenAI API and turn each token's arrival time into the run's figures.

Per request the client records when each token arrives: time to first token (TTFT), time per
output token after the first (TPOT), every inter-token gap (ITL) and end-to-end latency. Over
the OpenAI API it also asks for the server's usage chunk (prompt tokens read, tokens
generated), so a server that tokenized the prompt differently or streamed tokens the client
did not count shows up in `summarize`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.benchmarks.report import Report


@dataclass
class Outcome:
    prompt_tokens: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    finished: bool = False
    index: int = -1  # the request's place in the workload
    # From the server's final usage chunk (OpenAI API): what it says it read and generated.
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    text: list[str] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's own count when it sent one, else the tokens seen."""
        return len(self.token_times) if self.usage_completion_tokens is None else self.usage_completion_tokens

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


def prompts_for(args: argparse.Namespace, n: int, seed: int) -> list[list[int]]:
    """`n` prompts of the chosen workload; another `seed` gives other prompts (the warm-up's)."""
    if args.workload == "random":
        rng = random.Random(seed)
        return [[rng.randrange(10, 300) for _ in range(args.input_len)] for _ in range(n)]
    from transformers import AutoTokenizer

    from pagedserve.benchmarks.workloads import chat_prompts
    from pagedserve.common.models import resolve_model_path

    # The launched servers' model tokenizes the workload unless --tokenizer names another.
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer or args.serve_model))
    return chat_prompts(tokenizer, n=n, seed=seed)


class GrpcTarget:
    def __init__(self, address: str, api_key: str | None) -> None:
        from pagedserve.clients.python import AsyncGenerationClient
        from pagedserve.clients.python.retry import NO_RETRY

        # No client retries: a refused request counts as refused (the HTTP target does not retry).
        self.client = AsyncGenerationClient(address, api_key=api_key, retry=NO_RETRY)

    async def run(self, prompt: list[int], max_tokens: int, outcome: Outcome) -> None:
        from pagedserve.clients.python import Completion

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


def tokens_in_choice(choice: dict[str, Any]) -> int:
    """Tokens one streamed completion choice carries. vLLM lists them (`token_ids`, asked for
    with `return_token_ids`) and sends the last one in the chunk with the finish_reason;
    pagedserve ignores that field, sends one chunk per token delta (its text may be empty
    mid-character) and ends with a chunk that only carries the finish_reason."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if choice.get("finish_reason") is None else 0


class OpenAITarget:
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
            # The usage chunk says how many prompt tokens the server read and how many it
            # generated; token ids per chunk make vLLM's token count exact.
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
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
                usage = chunk.get("usage")
                if usage:
                    outcome.usage_prompt_tokens = int(usage["prompt_tokens"])
                    outcome.usage_completion_tokens = int(usage["completion_tokens"])
                if chunk["choices"]:
                    choice = chunk["choices"][0]
                    now = time.perf_counter()
                    outcome.token_times.extend([now] * tokens_in_choice(choice))
                    outcome.text.append(choice.get("text") or "")
        finally:
            writer.close()

    async def close(self) -> None:
        pass


async def warm_up(target: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """Send `prompts` at once with `max_tokens` each, untimed; a failure means a broken server."""
    outcomes = [Outcome(len(p), time.perf_counter()) for p in prompts]
    await asyncio.gather(*(target.run(p, max_tokens, o) for p, o in zip(prompts, outcomes, strict=True)))
    bad = [o for o in outcomes if not o.finished or o.output_tokens != max_tokens]
    if bad:
        raise RuntimeError(f"warm-up: {len(bad)}/{len(prompts)} requests did not return {max_tokens} tokens")


async def drive(
    args: argparse.Namespace, target: Any, prompts: list[list[int]], lengths: list[int], report: Report
) -> tuple[list[Outcome], float]:
    """Send the workload (`--concurrency` closed loop or `--request-rate` arrivals) and close
    `target`; returns each request's outcome (in start order) and the run's wall time."""
    outcomes: list[Outcome] = []
    bar = report.bar(len(prompts), "requests")
    rng = random.Random(args.seed + 1)
    start = time.perf_counter()
    deadline = start + args.max_duration

    async def one(i: int) -> None:
        outcome = Outcome(len(prompts[i]), time.perf_counter(), index=i)
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


def completed(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.finished and o.error is None]


def samples(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Seconds per completed request (TTFT, TPOT, E2E) and per inter-token gap (ITL)."""
    done = completed(outcomes)
    return {
        "TTFT": [o.ttft for o in done if o.ttft is not None],
        "TPOT": [o.tpot for o in done if o.tpot is not None],
        "ITL": [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:], strict=False)],
        "E2E": [o.e2e for o in done if o.e2e is not None],
    }


def summarize(outcomes: list[Outcome], wall: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict[str, Any]:
    """Every figure of one run: counts, rates, latency percentiles in ms, and what the
    servers' usage chunks say about the tokens (prompts read as sent, tokens counted)."""
    done = completed(outcomes)
    failed = [o for o in outcomes if o.error is not None]
    tokens = sum(o.output_tokens for o in outcomes)
    good = [
        o
        for o in done
        if (o.ttft or 0) * 1000 <= ttft_slo_ms and (o.tpot is None or o.tpot * 1000 <= tpot_slo_ms)
    ]
    stats: dict[str, dict[str, float]] = {}
    for name, values in samples(outcomes).items():
        q = {f"p{p}": percentile(values, p) * 1000 for p in (50, 90, 99)}
        stats[name] = {**q, "mean": 1000 * sum(values) / len(values) if values else math.nan}
    reported = [o for o in done if o.usage_prompt_tokens is not None]
    return {
        "completed": len(done),
        "requests": len(outcomes),
        "failed": len(failed),
        "errors": sorted({o.error for o in failed if o.error})[:3],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(done) / wall,
        "goodput_requests_per_s": len(good) / wall,
        "goodput_fraction": len(good) / max(1, len(done)),
        "latency_ms": stats,
        # Completed requests whose usage chunk says the server read exactly the ids sent /
        # generated exactly the tokens the stream delivered (None: the API sends no usage).
        "prompt_tokens_as_sent": sum(o.usage_prompt_tokens == o.prompt_tokens for o in reported)
        if reported
        else None,
        "tokens_counted_as_reported": sum(o.usage_completion_tokens == len(o.token_times) for o in reported)
        if reported
        else None,
    }


def plot_cdf(ax: Any, seconds: list[float], name: str, label: str | None) -> None:
    xs = sorted(v * 1000 for v in seconds)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set_xlabel(f"{name}, ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
