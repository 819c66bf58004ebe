"""The README's Python snippets run as written against a live `pagedserve serve` on the default
model; only the ports are the test server's instead of 50051/8000. Its claims that a test can
check are checked: the status paragraph against the repository, every path it names, every
flag and benchmark it lists."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    # Quickstart (OpenAI), offline API, gRPC client, structured outputs (OpenAI parse), tool
    # calling: a missing block would pass silently below.
    assert len(blocks) == 5
    assert "from openai import OpenAI" in blocks[0]
    assert "from pagedserve.dataplane import LLM, SamplingParams" in blocks[1]
    assert "GenerationClient" in blocks[2]
    assert "response_format=City" in blocks[3]
    assert 'tool_choice="required"' in blocks[4]


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


@pytest.mark.parametrize("index", range(5))
def test_readme_python_snippet_runs(index: int, server: tuple[str, str], tmp_path: Path) -> None:
    grpc_address, http_address = server
    code = python_blocks()[index]
    code = code.replace("127.0.0.1:50051", grpc_address).replace("127.0.0.1:8000", http_address)
    out = _run(code, tmp_path)
    if index == 0:  # the OpenAI quickstart: the answer the README shows in its comment
        assert "Paris" in out
    elif index == 1:  # offline greedy text, then a sampled chat reply
        assert out.startswith(" Paris") or "Paris" in out.splitlines()[0]
    elif index == 2:  # gRPC: the greedy completion, then the async n=2 sampled list
        assert "Paris" in out.splitlines()[0]
        assert out.rstrip().splitlines()[-1].startswith("[")
    elif index == 3:  # structured outputs: the parsed object the README shows in its comment
        assert out.strip() == "name='Paris' country='France'"
    else:  # tool calling: the forced call the README shows in its comment
        assert out.strip() == "get_weather {'city': 'Paris', 'unit': 'celsius'} tool_calls"


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
    from pagedserve.benchmarks.cli import SCRIPTS, SUBCOMMANDS

    listed = {line.split()[2] for line in _pagedserve_command_lines() if line.split()[1:2] == ["bench"]}
    assert sorted(set(SUBCOMMANDS) | set(SCRIPTS)) == sorted(listed)


def _parser_facts() -> tuple[set[str], set[str], set[str]]:
    """Every subcommand name, option string and choice of the `pagedserve` command."""
    from pagedserve.cli import build_parser

    commands: set[str] = set()
    choices: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    commands.add(name)
                    walk(child)
            elif action.choices is not None:
                choices.update(str(c).lower() for c in action.choices)

    parser = build_parser()
    walk(parser)
    return commands, _options_of(parser), choices


def _openai_accepts(field: str, value: object) -> bool:
    """The OpenAI API takes `field` with this value (it is not among the refused parameters)."""
    from pagedserve.controlplane.openai.protocol import UNSUPPORTED

    return field not in UNSUPPORTED or UNSUPPORTED[field](value)


def _exists(path: str) -> bool:
    return (REPO / path).exists()


@dataclass(frozen=True)
class Component:
    """Something the status paragraph says is in, or next: the words that name it, and how
    this repository shows that it is built."""

    name: str
    words: str  # a regex, searched in the paragraph
    built: Callable[[], bool]


def _command(name: str) -> Callable[[], bool]:
    return lambda: name in _parser_facts()[0]


def _option(*names: str) -> Callable[[], bool]:
    return lambda: set(names) <= _parser_facts()[1]


COMPONENTS = (
    Component(
        "the data-plane engine",
        r"data-plane engine",
        lambda: _exists("dataplane/src/pagedserve/dataplane/engine/llm_engine.py"),
    ),
    Component(
        "the offline LLM API",
        r"`LLM`\s+API",
        lambda: _exists("dataplane/src/pagedserve/dataplane/engine/llm.py"),
    ),
    Component("prefix caching", r"prefix caching", _option("--enable-prefix-caching")),
    Component("the two planes over gRPC", r"pagedserve serve", _command("serve")),
    Component(
        "the Python client",
        r"Python client",
        lambda: _exists("clients/python/src/pagedserve/clients/python/client.py"),
    ),
    Component(
        "the OpenAI HTTP API",
        r"OpenAI-compatible HTTP",
        lambda: _exists("controlplane/src/pagedserve/controlplane/openai/routes.py"),
    ),
    Component("API keys", r"API\s+keys", _option("--api-key", "--api-key-file")),
    Component("TLS/mTLS", r"TLS/mTLS", _option("--tls-cert-file", "--tls-client-ca-file")),
    Component(
        "Prometheus metrics",
        r"Prometheus",
        lambda: _exists("controlplane/src/pagedserve/controlplane/metrics.py"),
    ),
    Component(
        "OpenTelemetry tracing",
        r"OpenTelemetry",
        lambda: _exists("common/src/pagedserve/common/telemetry.py"),
    ),
    Component("pagedserve doctor", r"pagedserve doctor", _command("doctor")),
    Component(
        "Triton kernels",
        r"Triton paged attention",
        lambda: _exists("kernels/src/pagedserve/kernels/triton_ops"),
    ),
    Component("an FP8 KV cache", r"FP8 KV cache", lambda: "fp8_e4m3" in _parser_facts()[2]),
    Component("the benchmark suite", r"pagedserve bench", _command("bench")),
    Component("the Helm chart", r"\bHelm\b", lambda: _exists("helm/pagedserve/Chart.yaml")),
    Component("the Go client", r"\bGo\b", lambda: _exists("clients/go/go.mod")),
    Component("the Java client", r"\bJava\b", lambda: _exists("clients/java/pom.xml")),
    Component("CPU tensor parallelism", r"tensor\s+parallelism", _option("--tensor-parallel-size")),
    Component(
        "per-ISA CPU kernels",
        r"AVX-512",
        lambda: (
            "avx512" in (REPO / "kernels/src/pagedserve/kernels/cpu_isa.py").read_text()
            and _exists("kernels/src/pagedserve/kernels/cpu")
        ),
    ),
    # Not built while the OpenAI API refuses them with 400 (controlplane/src/pagedserve/controlplane/openai/protocol.py).
    Component(
        "structured outputs",
        r"structured outputs",
        lambda: _openai_accepts("response_format", {"type": "json_schema", "json_schema": {}}),
    ),
    Component(
        "tool calling",
        r"tool calling",
        lambda: _openai_accepts("tools", [{"type": "function", "function": {"name": "f"}}]),
    ),
    # Built once some flag loads them (vLLM's --quantization, or an int8/GGUF choice).
    Component(
        "quantized weights",
        r"quantized|GGUF|int8",
        lambda: "--quantization" in _parser_facts()[1] or bool({"int8", "gguf"} & _parser_facts()[2]),
    ),
    # Built once the quantized kernel multiplies in integers (VNNI's vpdpbusd, or vpmaddubsw).
    Component(
        "integer dot products",
        r"integer\s+dot\s+products",
        lambda: all(
            op in (REPO / "kernels/src/pagedserve/kernels/cpu/panel_quant.h").read_text()
            for op in ("_mm512_dpbusd_epi32", "_mm256_maddubs_epi16")
        ),
    ),
    # Built once the quantized kernel uses ARM's dot-product instructions (SDOT).
    Component(
        "NEON dot products",
        r"NEON\s+dot\s+products",
        lambda: "vdotq_s32" in (REPO / "kernels/src/pagedserve/kernels/cpu/panel_quant.h").read_text(),
    ),
)


def status_paragraph() -> str:
    found = re.search(r"^Status:(.*?)\n\n", README.read_text(), flags=re.S | re.M)
    assert found, "the README has no 'Status:' paragraph"
    return " ".join(found.group(1).split())


def stale_status_claims(paragraph: str) -> list[str]:
    """What the status paragraph says that the repository contradicts (empty: all true)."""
    done, sep, next_part = paragraph.partition("Next:")
    if not sep:
        return ["no 'Next:' part"]
    problems = []
    for c in COMPONENTS:
        in_done, in_next = re.search(c.words, done), re.search(c.words, next_part)
        if not (in_done or in_next):
            problems.append(f"{c.name} is no longer mentioned: update COMPONENTS in this test")
        elif in_next and c.built():
            problems.append(f"{c.name} is built but listed under Next")
        elif in_done and not c.built():
            problems.append(f"{c.name} is claimed but not in the repository")
    for item in re.split(r",|\band\b", next_part.strip().rstrip(".")):
        if item.strip() and not any(re.search(c.words, item) for c in COMPONENTS):
            problems.append(f"Next: {item.strip()!r} has no check: add it to COMPONENTS")
    return problems


def test_the_status_paragraph_is_true_today() -> None:
    assert stale_status_claims(status_paragraph()) == []


def test_the_status_check_catches_a_stale_paragraph() -> None:
    paragraph = status_paragraph()
    stale = paragraph.replace("the **Helm chart**,", "").replace("Next:", "Next: the Helm chart,")
    assert stale != paragraph
    assert stale_status_claims(stale) == ["the Helm chart is built but listed under Next"]
    unchecked = paragraph.replace("Next:", "Next: speculative decoding,")
    assert stale_status_claims(unchecked) == [
        "Next: 'speculative decoding' has no check: add it to COMPONENTS"
    ]


# A path into the repository: a top-level folder, then anything path-like (URLs, `~/...` and
# `/abs/...` do not match: the folder must not follow a word character, `/`, `.` or `~`).
_REPO_PATH = re.compile(
    r"(?<![\w/.~-])((?:docs|benchmarks|clients|helm|tests|dataplane|controlplane|kernels|pagedserve|protos)/[\w./*-]*)"
)


def readme_paths() -> set[str]:
    """Every repository path the README names, outside the untagged code block of the source
    tree (its entries are relative to the folder above them) and without `#anchor`s."""
    blocks = re.compile(r"^```(\w*)\n.*?^```", flags=re.S | re.M)  # each block, fence to fence
    text = blocks.sub(lambda block: block.group(0) if block.group(1) else "", README.read_text())
    return {path.rstrip(".") for path in _REPO_PATH.findall(text)}


def test_every_path_the_readme_names_exists() -> None:
    paths = readme_paths()
    assert {"docs/api.md", "benchmarks/README.md", "helm/pagedserve/", "clients/go"} <= paths
    missing = [p for p in sorted(paths) if not (glob.glob(str(REPO / p)) if "*" in p else _exists(p))]
    assert missing == []


def _strip_comment(line: str) -> str:
    """`line` without its shell comment (a `#` outside quotes, at the start or after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_commands() -> list[str]:
    """Every command of the README's ```bash blocks: continued lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            command = _strip_comment(line).strip()
            if command:
                commands.append(command)
    return commands


@dataclass(frozen=True)
class Shell:
    """What this test does with the README commands that start with `prefix`: run them (`live`:
    against the server fixture, its addresses in place of 127.0.0.1:50051/8000), or not, and why."""

    prefix: str
    run: bool
    why: str
    live: bool = False
    timeout_s: float = 60.0
    needs: str | None = None  # a program on PATH, or a path (with a /) in the checkout; else skipped
    expect: str | None = None  # printed on stdout
    in_repo: bool = False  # runs in the checkout (it names repository paths); else in a temp dir


# Every README shell command, by its start (the first match wins). A command without a rule
# fails test_every_readme_shell_command_is_classified; a rule that matches nothing, too.
SHELL = (
    Shell(
        "make serve", False, "installs the venv, then serves on the default ports: the fixture is its `serve`"
    ),
    Shell("make test", False, "the whole suite, this test included"),
    Shell(
        "make clients",
        False,
        "builds the Go and Java clients (minutes); tests/e2e/clients builds them with the same build.sh",
    ),
    Shell("python3 -m venv", False, "creates a venv and installs from the package index"),
    Shell(
        "client-venv/bin/pagedserve-client generate",
        False,
        "needs the client-only venv; tests/test_packaging.py installs the client in an empty venv and runs it",
    ),
    Shell(".venv/bin/pagedserve client generate", True, "calls the server", live=True, expect="Paris"),
    Shell(
        "pagedserve models pull --model-home",
        False,
        "a second store: extracts and converts the model again (minutes, 0.5 GB written)",
    ),
    Shell(
        "pagedserve models pull", True, "idempotent: the model is in the store already (make test pulls it)"
    ),
    Shell("pagedserve models list", True, "reads the store"),
    Shell("pagedserve serve [", False, "a synopsis ([optional] flags); the fixture runs `pagedserve serve`"),
    Shell(
        "pagedserve serve --",
        False,
        "a long-running server on the default ports; tests/e2e/grpc/test_serve_gguf.py serves the Q4_1 file, "
        "tests/dataplane/test_int8_quantization.py and test_gguf_models.py cover int8 and GGUF paths",
    ),
    *(
        Shell(
            f"build/{lang}/bin/pagedserve-generate ",
            True,
            f"the {lang.title()} example, once `make clients` has built it (tests/e2e/clients runs it too)",
            live=True,
            timeout_s=120.0,
            needs=f"build/{lang}/bin/pagedserve-generate",
            expect="Paris",
            in_repo=True,
        )
        for lang in ("go", "java")
    ),
    Shell("grpcurl ", True, "calls the server through reflection", live=True, needs="grpcurl"),
    Shell("pagedserve dataplane ", False, "a long-running data plane on a fixed port, one per node"),
    Shell(
        "pagedserve controlplane ",
        False,
        "long-running, and its data planes' addresses are another network's",
    ),
    Shell("docker ", False, "no Docker engine in CI (tests/deploy/test_dockerfile.py checks the Dockerfile)"),
    Shell(
        "helm template ",
        True,
        "renders the chart, no cluster needed (tests/deploy renders it without the helm binary)",
        needs="helm",
        in_repo=True,
    ),
    Shell("helm ", False, "needs a Kubernetes cluster"),
    Shell("kubectl ", False, "needs a Kubernetes cluster"),
    # The offline commands load the model in their own process (and build the CPU kernels on a
    # first run): a longer bound than the calls to the live server.
    Shell("pagedserve generate ", True, "generates offline", timeout_s=240.0),
    Shell("pagedserve chat ", True, "one question on stdin, then EOF", timeout_s=240.0, expect="Paris"),
    Shell("pagedserve bench plan", True, "arithmetic only (writes its results in the temp dir)"),
    Shell("pagedserve bench ", False, "a benchmark: minutes of load each (benchmarks/ has its own tests)"),
)
CHAT_STDIN = "What is the capital of France?\n"


def shell_rule(command: str) -> Shell | None:
    return next((rule for rule in SHELL if command.startswith(rule.prefix)), None)


def test_every_readme_shell_command_is_classified() -> None:
    commands = shell_commands()
    assert len(commands) > 20, commands
    assert [c for c in commands if shell_rule(c) is None] == []
    used = {shell_rule(c) for c in commands}
    assert [rule.prefix for rule in SHELL if rule not in used] == []  # stale rules


def _live(command: str, grpc_address: str, http_address: str) -> str:
    command = command.replace("127.0.0.1:50051", grpc_address).replace("127.0.0.1:8000", http_address)
    if " client generate " in command and "--address" not in command:  # the default, 127.0.0.1:50051
        command = command.replace(" client generate ", f" client generate --address {grpc_address} ", 1)
    return command


RUNNABLE = [c for c in shell_commands() if (r := shell_rule(c)) is not None and r.run]


# Explicit ids: pytest would name the commands with quotes or braces "command3".
@pytest.mark.parametrize("command", RUNNABLE, ids=[re.sub(r"[^\w./:-]+", "_", c)[:70] for c in RUNNABLE])
def test_readme_shell_command_runs(command: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    rule = shell_rule(command)
    assert rule is not None
    if rule.needs is not None and not (
        _exists(rule.needs) if "/" in rule.needs else shutil.which(rule.needs)
    ):
        pytest.skip(f"{rule.needs} is not here: {rule.why}")
    if rule.live:
        grpc_address, http_address = request.getfixturevalue("server")
        command = _live(command, grpc_address, http_address)
    bin_dir = Path(sys.executable).parent  # the venv's pagedserve, called bare or as .venv/bin/
    command = re.sub(r"^\.venv/bin/", f"{bin_dir}/", command)
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=REPO if rule.in_repo else tmp_path,
        env={
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
        },
        input=CHAT_STDIN,
        capture_output=True,
        text=True,
        timeout=rule.timeout_s,
    )
    assert done.returncode == 0, (
        f"`{command}` exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    if rule.expect is not None:
        assert rule.expect in done.stdout, done.stdout[-2000:]
