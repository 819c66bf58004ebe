"""A burst of Generate calls at once against `pagedserve serve`: every call ends OK,
RESOURCE_EXHAUSTED with a retry-after hint, or DEADLINE_EXCEEDED (the queue timeout); none as
a bare CANCELLED; every refusal is counted in /metrics; the log says so in a few lines.

grpc-core dropped calls it had not handed to the application yet once more than 1,000 were
waiting (all past 3,000), a bare CANCELLED with no log and no count: 5,173 of 10,000 in the
issue, ~80-200 of 2,000 here before the fix. 3,000 calls overflow that backlog on this machine
and still fit CI; the figures at 10,000 are in docs/operations.md. A small admission queue
(64, 0.5 s) and a KV pool that holds five requests at once (16 blocks, 3 each) make the
refusals happen at this scale however fast the machine; the outcome counts are printed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.controlplane.refusals import REFUSAL_LOG_INTERVAL_S
from pagedserve.protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import Process

CALLS = int(os.environ.get("PAGEDSERVE_BURST_CALLS", "3000"))  # 10000 for the docs' figures
CHANNELS = 10
ENDINGS = {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    model = make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")
    argv = ["serve", "--model", str(model), "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
    argv += ["--num-gpu-blocks-override", "16", "--max-model-len", "64"]
    argv += ["--max-queue-len", "64", "--queue-timeout", "0.5"]
    proc = Process(argv, "gRPC on ")
    yield proc
    proc.kill(15)


async def _burst(address: str) -> tuple[collections.Counter[str], int]:
    """Each call's ending by status, and how many RESOURCE_EXHAUSTED carried retry-after."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in channels]
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True),
    )
    endings: collections.Counter[str] = collections.Counter()
    hinted = 0

    async def call(i: int) -> None:
        nonlocal hinted
        try:
            async for _ in stubs[i % CHANNELS].Generate(request, timeout=300):
                pass
            endings["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            endings[exc.code().name] += 1
            trailing = dict(exc.trailing_metadata() or ())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and float(trailing.get("retry-after", 0)) > 0:
                hinted += 1

    try:
        await asyncio.gather(*(call(i) for i in range(CALLS)))
    finally:
        for channel in channels:
            await channel.close()
    return endings, hinted


def _failures(http_port: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
    found = re.findall(r'^pagedserve_request_failure_total\{code="(\w+)"\} (\S+)$', text, re.M)
    return {code: float(value) for code, value in found}


def test_a_burst_ends_ok_or_refused_with_a_hint_never_cancelled(served: Process) -> None:
    started = time.monotonic()
    endings, hinted = asyncio.run(_burst(served.address))
    elapsed = time.monotonic() - started
    print(f"\n{CALLS} calls at once over {CHANNELS} channels in {elapsed:.1f} s: {dict(endings)}")

    assert sum(endings.values()) == CALLS
    assert set(endings) <= ENDINGS, endings  # above all, no CANCELLED
    assert endings["RESOURCE_EXHAUSTED"] > 0, "the burst should have overflowed the queue of 64"
    assert hinted == endings["RESOURCE_EXHAUSTED"]

    http_port = re.search(r"HTTP on http://[^:]+:(\d+)", served.line)
    assert http_port is not None, served.line
    counted = _failures(http_port.group(1))
    refused = {code: n for code, n in endings.items() if code != "OK"}
    assert counted == refused  # every refusal counted once, nothing else failed

    # Logged by reason, not per call: the first of each reason at once, then at most one
    # line per reason per interval.
    lines = [json.loads(line) for line in served.stderr().splitlines() if '"requests_refused"' in line]
    assert {line["code"] for line in lines} == set(refused)
    reasons = {(line["code"], re.sub(r"\d+(?:\.\d+)?", "N", line["reason"])) for line in lines}
    assert len(lines) <= len(reasons) * (2 + elapsed / REFUSAL_LOG_INTERVAL_S)
    assert sum(line["count"] for line in lines) <= sum(refused.values())
