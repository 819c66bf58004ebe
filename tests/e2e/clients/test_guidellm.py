"""guidellm, the benchmark tool users reach for first, runs against `pagedserve serve` as it is.

guidellm sends `stream_options: {"include_usage": true, "continuous_usage_stats": true}`,
`max_completion_tokens` and `ignore_eos` on every streamed chat request; a server that refuses
any of them fails all its requests. It is installed into its own cached venv (our CPU torch pin,
benchmarks/src/pagedserve/benchmarks/peer_venv.py; ~1 min the first time) and runs synchronously and at concurrency 4 on
synthetic prompts: every request completes with exactly the tokens asked for, none errors, and
the data plane's KV pool is all free afterwards.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.benchmarks.peer_venv import PeerVenv
from pagedserve.common.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path
from tests.e2e.harness import Process

pytestmark = pytest.mark.real_model

GUIDELLM = PeerVenv(
    name="guidellm-0.8.1",
    install=("guidellm==0.8.1",),
    probe="import guidellm.version as v; print(v.version)",
    size_note="~1 min, ~1.5 GB",
)
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def guidellm() -> Path:
    return GUIDELLM.ensure(progress=False) / "bin" / "guidellm"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Path]]:
    try:
        model = resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.fail(f"{exc} (make test pulls it)")
    proc = Process(["serve", "--grpc-port", "0", "--http-port", "0", "--threads", "1"], "gRPC on ")
    http = proc.line.rsplit("http://", 1)[1].strip()
    yield f"http://{http}", model
    proc.kill(signal.SIGINT)


def _metrics(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        return response.read().decode()


def _kv_usage(base: str) -> float:
    found = re.search(r"^pagedserve_kv_cache_usage_perc\{[^}]*\} (\S+)$", _metrics(base), flags=re.M)
    assert found is not None, "no pagedserve_kv_cache_usage_perc in /metrics"
    return float(found.group(1))


def _completions(base: str) -> tuple[float, float]:
    """The control plane's finished completions and failed requests so far (every label summed)."""
    text = _metrics(base)

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, flags=re.M))

    return total("pagedserve_request_success_total"), total("pagedserve_request_failure_total")


@pytest.mark.parametrize(("profile", "requests"), [("kind=synchronous", 3), ("kind=concurrent,streams=4", 8)])
def test_guidellm_completes_every_request(
    guidellm: Path, served: tuple[str, Path], tmp_path: Path, profile: str, requests: int
) -> None:
    base, model = served
    report = tmp_path / "report.json"
    argv = [str(guidellm), "run", "--backend", f"kind=openai_http,target={base}", "--profile", profile]
    argv += ["--constraint", f"kind=max_requests,count={requests}"]
    argv += ["--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}"]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={model}"]
    argv += ["--output", f"kind=json,path={report}", "--disable-progress"]
    before = _completions(base)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    succeeded, failed = (a - b for a, b in zip(_completions(base), before, strict=True))
    # Every request guidellm sent completed on the server, none failed. (guidellm's own report
    # leaves out a request that ends outside its measurement window, which on a loaded machine
    # happens to the last one now and then: its count may fall short, never its errors.)
    assert succeeded >= requests and failed == 0, (succeeded, failed)

    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == totals["incomplete"] == 0 and 1 <= totals["successful"] <= requests, totals
    successful = benchmark["requests"]["successful"]
    assert [r["output_tokens"] for r in successful] == [OUTPUT_TOKENS] * totals["successful"]
    body = json.loads(successful[0]["request_args"])["body"]
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}

    # Stats reach the control plane every few hundred ms: wait for the pool, bounded.
    deadline = time.monotonic() + 60
    while _kv_usage(base) != 0.0:
        assert time.monotonic() < deadline, "the KV pool did not come back after guidellm's requests"
        time.sleep(0.2)
