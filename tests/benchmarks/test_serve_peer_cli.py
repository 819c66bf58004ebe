"""`pagedserve bench serve --launch / --peer vllm`, without vLLM (a peer, never a dependency):
flag handling, the commands and environments the servers get, the figures of a run and the
side-by-side table from fake outcomes, and one real launch of `pagedserve serve` on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from pagedserve.benchmarks import serve, serve_peers, serve_peers_report
from pagedserve.benchmarks.serve_load import Outcome, summarize, tokens_in_choice
from pagedserve.cli import main


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def validated(*argv: str) -> argparse.Namespace:
    args = parse(*argv)
    serve_peers.validate(args)
    return args


def test_launching_drives_the_openai_api_with_16_streams_by_default() -> None:
    args = validated("--launch")
    assert (args.api, args.concurrency, args.address) == ("openai", 16, None)
    assert (args.threads, args.kv_cache_memory, args.max_num_seqs, args.warmup) == (2, 2 * 2**30, 64, 4)
    assert validated("--launch", "--concurrency", "4").concurrency == 4
    assert validated("--launch", "--request-rate", "2").concurrency is None  # open loop as asked
    assert validated().api == "grpc"  # a running server, as before
    assert validated("--api", "openai").concurrency is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launch", "--address", "127.0.0.1:50051"], "--address: not with --launch/--peer"),
        (["--peer", "vllm", "--api", "grpc"], "--api grpc: --launch/--peer drive the OpenAI API"),
        (["--launch", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["--launch", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
        (["--launch", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--launch", "--launch-timeout", "0"], "--launch-timeout must be > 0"),
        (["--launch", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    ],
)
def test_bad_flags_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validated(*argv)


def test_a_peer_python_without_vllm_is_refused_before_any_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # This venv has no vLLM: the run stops at the flag, exit status 1, no server launched.
    assert main(["bench", "serve", "--peer", "vllm", "--vllm-python", sys.executable, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"--vllm-python: {sys.executable} cannot import vllm" in err


def test_both_servers_get_the_same_limits_and_vllm_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    args = validated("--launch", "--threads", "2", "--kv-cache-memory", "1536MiB", "--max-num-seqs", "32")
    args.vllm_python, args.vllm_version = "/peer/bin/python", "0.32.0"
    ours = serve_peers.pagedserve_spec(args, tmp_path)
    assert ours.argv[:4] == [sys.executable, "-m", "pagedserve", "serve"]
    flags = dict(zip(ours.argv[4::2], ours.argv[5::2], strict=True))
    assert flags["--model"] == str(tmp_path) and flags["--dtype"] == "float32"
    assert (flags["--http-port"], flags["--grpc-port"]) == (str(ours.port), "0")
    assert (flags["--threads"], flags["--kv-cache-memory"]) == ("2", str(1536 * 2**20))
    assert (flags["--max-num-seqs"], flags["--max-num-batched-tokens"]) == ("32", "2048")
    assert ours.env is None

    peer = serve_peers.vllm_spec(args, tmp_path)
    assert peer.name == "vLLM serve 0.32.0"
    assert peer.argv[:3] == ["/peer/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert peer.argv[-1] == "--disable-uvicorn-access-log"
    flags = dict(zip(peer.argv[3:-1:2], peer.argv[4:-1:2], strict=True))
    assert (flags["--model"], flags["--dtype"], flags["--port"]) == (str(tmp_path), "float32", str(peer.port))
    assert (flags["--max-num-seqs"], flags["--max-num-batched-tokens"]) == ("32", "2048")
    assert peer.env is not None
    # 1.5 GiB of KV for us: vLLM takes whole GiB, so 2; both use 2 threads, vLLM's bound to cores 0-1.
    assert (peer.env["VLLM_CPU_KVCACHE_SPACE"], peer.env["OMP_NUM_THREADS"]) == ("2", "2")
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # the operator's own choice wins, reported
    assert serve_peers.vllm_spec(args, tmp_path).settings["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_our_kernel_flags_and_vllm_dtype_reach_the_servers(tmp_path: Path) -> None:
    args = validated("--launch")
    flags = dict(
        zip(*(lambda a: (a[4::2], a[5::2]))(serve_peers.pagedserve_spec(args, tmp_path).argv), strict=True)
    )
    # the engine's own defaults, from pagedserve.dataplane.config
    assert (flags["--cpu-linear"], flags["--cpu-weight-dtype"], flags["--kv-cache-dtype"]) == (
        "auto",
        "float32",
        "auto",
    )
    args = validated(
        "--launch",
        "--cpu-weight-dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "bfloat16",
        "--vllm-dtype",
        "bfloat16",
    )
    args.vllm_python, args.vllm_version = "/peer/bin/python", "0.32.0"
    ours = serve_peers.pagedserve_spec(args, tmp_path)
    flags = dict(zip(ours.argv[4::2], ours.argv[5::2], strict=True))
    assert (flags["--cpu-weight-dtype"], flags["--kv-cache-dtype"]) == ("bfloat16", "bfloat16")
    assert ours.settings["kv_cache_dtype"] == "bfloat16"
    peer = serve_peers.vllm_spec(args, tmp_path)
    flags = dict(zip(peer.argv[3:-1:2], peer.argv[4:-1:2], strict=True))
    assert flags["--dtype"] == "bfloat16" and peer.settings["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        parse("--launch", "--kv-cache-dtype", "int4")


def test_the_kernel_choice_is_read_from_our_servers_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    event = {
        "mode": "auto",
        "shapes": [
            {
                "shape": "576x960",
                "choice": "panel",
                "panel_ms": [0.1, 0.2],
                "onednn_ms": [0.2, 0.3],
                "reason": "timed",
            }
        ],
        "event": "cpu_kernels_selected",
    }
    log.write_text("starting\n" + "[dataplane] " + json.dumps(event) + "\n")
    selection = serve_peers_report.kernels_selected(log)
    assert [(c["in_features"], c["out_features"], c["choice"]) for c in selection] == [
        ("576", "960", "panel")
    ]
    assert serve_peers_report.kernels_selected(tmp_path / "missing.log") == []
    log.write_text('{"event": "dataplane_serving"}\n')
    assert serve_peers_report.kernels_selected(log) == []


def test_tokens_are_counted_in_both_servers_stream_formats() -> None:
    # vLLM (return_token_ids): the ids are listed, the last one rides with the finish_reason.
    assert tokens_in_choice({"text": " a", "token_ids": [7], "finish_reason": None}) == 1
    assert tokens_in_choice({"text": "", "token_ids": [8, 9], "finish_reason": "length"}) == 2
    # pagedserve: one chunk per token delta (empty text mid-character), then a bare finish chunk.
    assert tokens_in_choice({"text": "", "logprobs": None, "finish_reason": None}) == 1
    assert tokens_in_choice({"text": "", "logprobs": None, "finish_reason": "length"}) == 0


def outcome(index: int, sent: float, times: list[float], text: str, prompt: int = 5) -> Outcome:
    return Outcome(
        prompt,
        sent,
        times,
        finished=True,
        index=index,
        usage_prompt_tokens=prompt,
        usage_completion_tokens=len(times),
        text=[text],
    )


def fake_runs() -> tuple[list[Outcome], list[Outcome]]:
    ours = [outcome(0, 0.0, [0.1, 0.2, 0.4], "abc"), outcome(1, 0.0, [0.3, 0.4], "de")]
    peer = [
        outcome(0, 0.0, [0.2, 0.4, 0.8], "abc"),
        outcome(1, 0.0, [0.6, 0.8], "dx"),
        Outcome(5, 0.0, [0.5], error="RuntimeError: HTTP/1.1 500", index=2),
    ]
    return ours, peer


def test_a_run_is_summarized_from_the_token_arrival_times() -> None:
    ours, peer = fake_runs()
    s = summarize(ours, wall=1.0, ttft_slo_ms=200.0, tpot_slo_ms=1000.0)
    assert (s["completed"], s["requests"], s["failed"], s["output_tokens"]) == (2, 2, 0, 5)
    assert s["output_tokens_per_s"] == 5.0 and s["requests_per_s"] == 2.0
    assert s["goodput_requests_per_s"] == 1.0  # TTFT 100 ms meets 200 ms, 300 ms does not
    lat = s["latency_ms"]
    assert lat["TTFT"]["p50"] == pytest.approx(200.0) and lat["TTFT"]["p99"] == pytest.approx(298.0)
    assert lat["ITL"]["p50"] == pytest.approx(100.0)  # gaps 100, 200, 100 ms
    assert lat["TPOT"]["p50"] == pytest.approx(125.0)  # 150 ms and 100 ms per token after the first
    assert (s["prompt_tokens_as_sent"], s["tokens_counted_as_reported"]) == (2, 2)
    p = summarize(peer, wall=2.0, ttft_slo_ms=200.0, tpot_slo_ms=1000.0)
    assert (p["completed"], p["requests"], p["failed"], p["output_tokens"]) == (2, 3, 1, 6)
    assert p["errors"] == ["RuntimeError: HTTP/1.1 500"]


def test_the_side_by_side_table_and_ratios_from_two_fake_runs() -> None:
    ours, peer = fake_runs()
    a = summarize(ours, wall=1.0, ttft_slo_ms=2000.0, tpot_slo_ms=1000.0)
    b = summarize(peer, wall=2.0, ttft_slo_ms=2000.0, tpot_slo_ms=1000.0)
    header, rows = serve_peers_report.side_by_side(["pagedserve serve", "vLLM serve"], [a, b])
    assert header == ["metric", "pagedserve serve", "vLLM serve", "pagedserve serve / vLLM serve"]
    table = {row[0]: row[1:] for row in rows}
    assert table["completed"] == ["2/2", "2/3", "-"]
    assert table["failed"] == ["0", "1", "-"]
    assert table["output tok/s"] == ["5.0", "3.0", "1.67x"]  # 5 tokens in 1 s vs 6 in 2 s
    assert table["requests/s"] == ["2.00", "1.00", "2.00x"]
    assert table["TTFT p50 ms"] == ["200", "400", "0.50x"]
    assert table["ITL p50 ms"] == ["100.0", "200.0", "0.50x"]
    assert table["TPOT p50 ms"] == ["125.0", "250.0", "0.50x"]
    assert table["E2E p50 ms"] == ["400", "800", "0.50x"]
    assert serve_peers_report.ratios(a, b)["output tok/s"] == pytest.approx(5 / 3)
    assert serve_peers_report.same_text(ours, peer) == 1  # request 1's texts differ; 2 failed on the peer
    header, rows = serve_peers_report.side_by_side(["pagedserve serve"], [a])  # --launch alone
    assert header == ["metric", "pagedserve serve"] and rows[2] == ["output tok/s", "5.0"]


def test_launch_runs_pagedserve_serve_and_leaves_no_process(tmp_path: Path) -> None:
    from pagedserve.benchmarks.tiny_models import make_tiny_model

    tiny = make_tiny_model("llama", tmp_path / "llama")
    out = tmp_path / "out"
    argv = ["--launch", "--serve-model", str(tiny), "--workload", "random", "--input-len", "8"]
    argv += ["--num-prompts", "3", "--min-output", "2", "--max-output", "4", "--warmup", "1"]
    argv += ["--threads", "1", "--kv-cache-memory", "64MiB", "--concurrency", "2"]
    assert main(["bench", "serve", *argv, "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "serve.json").read_text())
    (server,) = doc["servers"]
    assert server["name"] == "pagedserve serve" and doc["mode"] == "2 streams"
    assert (server["completed"], server["failed"], server["output_tokens"]) == (3, 0, 2 + 3 + 4)
    assert (server["prompt_tokens_as_sent"], server["tokens_counted_as_reported"]) == (3, 3)
    assert (out / "serve.png").stat().st_size > 0
    log = (out / "pagedserve-serve.log").read_text()
    (child,) = (int(pid) for pid in re.findall(r"starting the data plane \(pid (\d+)\)", log))
    assert not alive(child)  # serve's data plane went with it (serve itself is reaped by the launcher)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
