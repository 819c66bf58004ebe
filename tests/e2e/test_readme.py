"""The README's Python snippets run as written against a live `pagedserve serve` on the default
model; only the ports are the test server's instead of 50051/8000."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.common.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path
from tests.e2e.harness import REPO, Process

pytestmark = pytest.mark.real_model

README = REPO / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_python_snippets() -> None:
    blocks = python_blocks()
    # Quickstart (OpenAI), offline API, gRPC client: a missing block would pass silently below.
    assert len(blocks) == 3
    assert "from openai import OpenAI" in blocks[0]
    assert "from dataplane import LLM, SamplingParams" in blocks[1]
    assert "GenerationClient" in blocks[2]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, str]]:
    try:
        resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.fail(f"{exc} (make test pulls it)")
    proc = Process(["serve", "--grpc-port", "0", "--http-port", "0", "--threads", "1"], "gRPC on ")
    # "pagedserve gRPC on HOST:PORT  HTTP on http://HOST:PORT"
    http = proc.line.rsplit("http://", 1)[1].strip()
    yield proc.address, http
    proc.kill(signal.SIGINT)


def _run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("index", range(3))
def test_readme_python_snippet_runs(index: int, server: tuple[str, str], tmp_path: Path) -> None:
    grpc_address, http_address = server
    code = python_blocks()[index]
    code = code.replace("127.0.0.1:50051", grpc_address).replace("127.0.0.1:8000", http_address)
    out = _run(code, tmp_path)
    if index == 0:  # the OpenAI quickstart: the answer the README shows in its comment
        assert "Paris" in out
    elif index == 1:  # offline greedy text, then a sampled chat reply
        assert out.startswith(" Paris") or "Paris" in out.splitlines()[0]
    else:  # gRPC: the greedy completion, then the async n=2 sampled list
        assert "Paris" in out.splitlines()[0]
        assert out.rstrip().splitlines()[-1].startswith("[")


def _options_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of all its subcommands, recursively."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= _options_of(child)
    return found


def _pagedserve_command_lines() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    lines = [line.split("#", 1)[0] for block in blocks for line in block.splitlines()]
    return [line for line in lines if re.match(r"\s*(\.venv/bin/)?pagedserve\s", line)]


def test_every_flag_the_readme_passes_to_pagedserve_exists() -> None:
    from pagedserve.cli import build_parser

    known = _options_of(build_parser())
    used = {
        flag for line in _pagedserve_command_lines() for flag in re.findall(r"\s(--[a-z][a-z0-9-]*)", line)
    }
    assert used, "no pagedserve command lines found in the README"
    assert sorted(used - known) == []


def test_the_readme_lists_every_benchmark() -> None:
    from benchmarks.cli import SCRIPTS, SUBCOMMANDS

    listed = {line.split()[2] for line in _pagedserve_command_lines() if line.split()[1:2] == ["bench"]}
    assert sorted(set(SUBCOMMANDS) | set(SCRIPTS)) == sorted(listed)
