"""The Go and Java clients end to end: each is built once per session from the committed sources
(`clients/go/build.sh`, `clients/java/build.sh`: Debian's toolchains, offline) and its example
command streams from a real server on the default model.

- the streamed text equals the Python client's for the same greedy request (plain and chat
  prompts, English and Chinese);
- a bad request prints the server's INVALID_ARGUMENT message naming the field;
- `--model` reaches the request: the served name works, another gets NOT_FOUND;
- a deadline shorter than the generation ends with DEADLINE_EXCEEDED, and Ctrl-C with exit 130,
  and either way the data plane's pool is all free again;
- over TLS with the test CA and an API key it works; a wrong key gets UNAUTHENTICATED;
- the retry policy (docs/api.md) makes exactly the Python client's attempts against the fake;
- structured outputs: `--json-schema` gives greedy JSON valid under the schema, ending with STOP
  and equal to the Python client's; `--choice` answers one of the choices; a schema the server
  cannot compile prints its INVALID_ARGUMENT naming `sampling_params.json_schema`.
- tool calling: `--tool` with `--tool-choice required` or `function:NAME` prints calls whose
  arguments validate under the tool's schema, finishing with "tool_calls";
  `--no-parallel-tool-calls` makes one call; the tool flags without `--chat` exit 2.

The Java example runs twice: iterating the blocking stub, and with `--async` (a StreamObserver).
Without go/javac/mvn the tests skip, saying what to install; PAGEDSERVE_REQUIRE_CLIENTS=1 (CI)
makes that a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient
from pagedserve.common.tls import ServerTLS
from pagedserve.controlplane.server import ControlPlane
from tests.e2e.certs import Pki, make_pki
from tests.e2e.clients.fake_server import EXPECTED_ATTEMPTS, PARTIAL, TEXT, FakeServer
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import REPO, ServerThread, engine_config, start_controlplane

REQUIRED = os.environ.get("PAGEDSERVE_REQUIRE_CLIENTS") == "1"
GO_PACKAGES = (
    "golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev"
)
JAVA_PACKAGES = "default-jdk-headless maven libgrpc-java libprotobuf-java (see .ci/run for the full list)"
TOKENS = 16
API_KEY = "sesame"
PROMPTS = {
    "plain": "The capital of France is",
    "plain-zh": "从前有座山，山里有座庙，",
    "chat": "What is the capital of France?",
    "chat-zh": "用中文解释一下KV缓存的工作原理。",
}


def _need(tools: Sequence[str], paths: Sequence[str], packages: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None] + [p for p in paths if not Path(p).exists()]
    if missing:
        message = f"{', '.join(missing)} not installed (apt-get install {packages}); CI installs them"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def _build(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"


@dataclass(frozen=True)
class Example:
    """A client's example command (`--address ... PROMPT`, the same flags in Go and Java)."""

    name: str
    argv: list[str]
    env: dict[str, str]

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*self.argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env
        )

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def run_all(self, runs: Sequence[Sequence[str]]) -> list[subprocess.CompletedProcess[str]]:
        """Several runs at once (the server batches them; the JVMs start in parallel)."""
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(lambda args: self.run(*args), runs))


@pytest.fixture(scope="session")
def go_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go examples (pagedserve-generate, pagedserve-quickstart), built once."""
    _need(["go"], ["/usr/share/gocode/src/google.golang.org/grpc"], GO_PACKAGES)
    out = tmp_path_factory.mktemp("go")
    _build([str(REPO / "clients/go/build.sh"), str(out)])
    return out / "bin"


@pytest.fixture(scope="session")
def java_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Launchers of the Java examples (pagedserve-generate, pagedserve-quickstart), built once."""
    _need(["javac", "mvn"], ["/usr/share/maven-repo/io/grpc/grpc-netty"], JAVA_PACKAGES)
    out = tmp_path_factory.mktemp("java")
    _build([str(REPO / "clients/java/build.sh"), str(out)])
    return out / "bin"


# A UTF-8 locale for the JVM: it decodes its arguments (the Chinese prompts) with the locale's charset.
JAVA_ENV = {**os.environ, "LC_ALL": "C.UTF-8"}


@pytest.fixture(params=["go", "java", "java-async"])
def example(request: pytest.FixtureRequest) -> Example:
    if request.param == "go":
        return Example(
            "go", [str(request.getfixturevalue("go_bin") / "pagedserve-generate")], dict(os.environ)
        )
    argv = [str(request.getfixturevalue("java_bin") / "pagedserve-generate")]
    if request.param == "java-async":
        argv.append("--async")
    return Example(request.param, argv, JAVA_ENV)


# -- a real server on the default model --------------------------------------------------------


@pytest.fixture(scope="module")
def server(default_model_path: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(default_model_path), default_model_path)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_address(server: ServerThread, default_model_path: Path, pki: Pki) -> Iterator[str]:
    """A second control plane on the same data plane: TLS (the test CA) and an API key."""
    cp: ControlPlane = server._run(
        start_controlplane(
            default_model_path,
            [server.dataplane.address],
            tls=ServerTLS(pki.server_cert, pki.server_key),
            api_keys=(API_KEY,),
        )
    )
    yield f"127.0.0.1:{cp.grpc_port}"
    server._run(cp.stop())


def _python_request(key: str) -> str | list[dict[str, str]]:
    text = PROMPTS[key]
    return [{"role": "user", "content": text}] if key.startswith("chat") else text


@pytest.fixture(scope="module")
def python_texts(server: ServerThread) -> dict[str, str]:
    """The Python client's greedy text for each prompt."""

    async def run() -> dict[str, str]:
        async with AsyncGenerationClient(server.grpc_address, timeout=120) as client:
            results = await asyncio.gather(
                *(client.generate(_python_request(k), max_tokens=TOKENS, temperature=0.0) for k in PROMPTS)
            )
        return {k: r[0].text for k, r in zip(PROMPTS, results, strict=True)}

    texts = asyncio.run(run())
    assert "Paris" in texts["plain"] + texts["chat"]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in texts["chat-zh"]), texts["chat-zh"]
    return texts


def _args(address: str, key: str, *extra: str) -> list[str]:
    chat = ["--chat"] if key.startswith("chat") else []
    return ["--address", address, "--max-tokens", str(TOKENS), *chat, *extra, PROMPTS[key]]


@pytest.mark.real_model
def test_streamed_text_equals_the_python_client(
    example: Example, server: ServerThread, python_texts: dict[str, str]
) -> None:
    runs = example.run_all([_args(server.grpc_address, key) for key in PROMPTS])
    for key, done in zip(PROMPTS, runs, strict=True):
        assert done.returncode == 0, (key, done.stderr)
        assert done.stdout == python_texts[key] + "\n", key
        assert f"+ {TOKENS} generated tokens" in done.stderr or "[stop;" in done.stderr, done.stderr
    server.wait_idle()


@pytest.mark.real_model
def test_a_bad_request_prints_the_servers_invalid_argument(example: Example, server: ServerThread) -> None:
    with GenerationClient(server.grpc_address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("x", temperature=-1.0)
    message = err.value.details()
    assert "sampling_params.temperature" in message
    done = example.run("--address", server.grpc_address, "--temperature", "-1", "x")
    assert done.returncode == 1
    assert f"error: INVALID_ARGUMENT: {message}" in done.stderr, done.stderr


@pytest.mark.real_model
def test_model_reaches_the_server(
    example: Example, server: ServerThread, python_texts: dict[str, str]
) -> None:
    """--model sets GenerateRequest.model: the served name works, any other is NOT_FOUND."""
    served = server.controlplane.dispatcher.config.model
    good, unknown = example.run_all(
        [
            _args(server.grpc_address, "plain", "--model", served),
            _args(server.grpc_address, "plain", "--model", "gpt-4"),
        ]
    )
    assert good.returncode == 0, good.stderr
    assert good.stdout == python_texts["plain"] + "\n"
    assert unknown.returncode == 1, unknown.stdout
    assert "error: NOT_FOUND:" in unknown.stderr and "'gpt-4' is not served here" in unknown.stderr, (
        unknown.stderr
    )


@pytest.mark.real_model
def test_a_short_deadline_ends_with_deadline_exceeded_and_frees_the_pool(
    example: Example, server: ServerThread
) -> None:
    start = time.monotonic()
    done = example.run(
        "--address", server.grpc_address, "--max-tokens", "500", "--timeout", "0.5", "Once upon a time,"
    )
    assert done.returncode == 1, done.stdout
    assert "error: DEADLINE_EXCEEDED" in done.stderr, done.stderr
    assert time.monotonic() - start < 20
    server.wait_idle()


@pytest.mark.real_model
def test_ctrl_c_cancels_the_stream_and_frees_the_pool(example: Example, server: ServerThread) -> None:
    proc = example.popen("--address", server.grpc_address, "--max-tokens", "800", "Once upon a time,")
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no token within 120 s"
        assert os.read(proc.stdout.fileno(), 100)  # tokens are arriving: the request is running
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert b"cancelled" in err
    server.wait_idle()


@pytest.mark.real_model
def test_tls_with_the_test_ca_and_an_api_key(
    example: Example, secure_address: str, pki: Pki, python_texts: dict[str, str]
) -> None:
    good, wrong, plaintext = example.run_all(
        [
            _args(secure_address, "plain", "--tls-ca-file", pki.ca, "--api-key", API_KEY),
            _args(secure_address, "plain", "--tls-ca-file", pki.ca, "--api-key", "wrong"),
            _args(secure_address, "plain", "--api-key", API_KEY, "--timeout", "10"),
        ]
    )
    assert good.returncode == 0, good.stderr
    assert good.stdout == python_texts["plain"] + "\n"
    assert wrong.returncode == 1 and "error: UNAUTHENTICATED: missing or invalid API key" in wrong.stderr
    assert plaintext.returncode == 1 and "error: UNAVAILABLE" in plaintext.stderr  # no TLS: no talk


@pytest.mark.real_model
@pytest.mark.parametrize("language", ["go", "java"])
def test_the_readme_quickstarts_print_the_python_clients_text(
    language: str, request: pytest.FixtureRequest, server: ServerThread
) -> None:
    """cmd/pagedserve-quickstart and Quickstart.java (the README's Go and Java snippets)."""
    with GenerationClient(server.grpc_address, timeout=120) as client:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        expected = client.generate(chat, max_tokens=32, temperature=0.0)[0].text
    quickstart = request.getfixturevalue(f"{language}_bin") / "pagedserve-quickstart"
    done = subprocess.run(
        [str(quickstart), server.grpc_address], capture_output=True, text=True, env=JAVA_ENV, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "Paris" in expected


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PERSON_PROMPT = "Give me a JSON object describing a person, with a name and an age."


@pytest.mark.real_model
def test_structured_outputs_json_schema_and_choice(example: Example, server: ServerThread) -> None:
    """--json-schema and --choice (at most one constraint flag) set SamplingParams' constraint."""
    with GenerationClient(server.grpc_address, timeout=120) as client:
        chat = [{"role": "user", "content": PERSON_PROMPT}]
        expected = client.generate(chat, max_tokens=64, temperature=0.0, json_schema=PERSON_SCHEMA)[0]
    assert expected.finish_reason == "stop"
    address = ["--address", server.grpc_address]
    person, answer, uncompilable = example.run_all(
        [
            [
                *address,
                "--max-tokens",
                "64",
                "--chat",
                "--json-schema",
                json.dumps(PERSON_SCHEMA),
                PERSON_PROMPT,
            ],
            [*address, "--max-tokens", "16", "--choice", "yes", "--choice", "no", "Is the sky blue? Answer:"],
            [*address, "--max-tokens", "8", "--json-schema", '{"$ref": "#/$defs/missing"}', "x"],
        ]
    )
    assert person.returncode == 0, person.stderr
    assert "[stop;" in person.stderr, person.stderr
    jsonschema.validate(json.loads(person.stdout), PERSON_SCHEMA)
    assert person.stdout == expected.text + "\n"
    assert answer.returncode == 0 and "[stop;" in answer.stderr, answer.stderr
    assert answer.stdout in ("yes\n", "no\n"), answer.stdout
    assert uncompilable.returncode == 1, uncompilable.stdout
    assert "error: INVALID_ARGUMENT: sampling_params.json_schema could not be compiled" in uncompilable.stderr
    both = example.run(*address, "--regex", "a", "--choice", "a", "x")
    assert both.returncode == 2 and "at most one constraint flag, got --regex and --choice" in both.stderr
    server.wait_idle()


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "parameters": WEATHER_PARAMETERS,
}


@pytest.mark.real_model
@pytest.mark.parametrize("language", ["go", "java"])
def test_tool_calls_required_and_named(
    language: str, request: pytest.FixtureRequest, server: ServerThread
) -> None:
    """--tool, --tool-choice and --no-parallel-tool-calls: after the text, one JSON line per
    completion with its finish reason, content and tool calls."""
    prompt = "Get the weather of Paris in celsius."  # (the default model ends its calls greedily)
    with GenerationClient(server.grpc_address, timeout=120) as client:
        chat = [{"role": "user", "content": prompt}]
        (expected,) = client.generate(
            chat, max_tokens=96, temperature=0.0, tools=[WEATHER_TOOL], tool_choice="required"
        )
    assert expected.finish_reason == "tool_calls", expected
    generate = request.getfixturevalue(f"{language}_bin") / "pagedserve-generate"
    example = Example(language, [str(generate)], JAVA_ENV)
    address = ["--address", server.grpc_address]
    tool = [*address, "--max-tokens", "96", "--chat", "--tool", json.dumps(WEATHER_TOOL)]
    required, single, named = example.run_all(
        [
            [*tool, "--tool-choice", "required", prompt],
            [*tool, "--tool-choice", "required", "--no-parallel-tool-calls", prompt],
            [*tool, "--tool-choice", "function:get_weather", prompt],
        ]
    )
    lines: dict[str, Any] = {}
    for choice, done in {"required": required, "single": single, "named": named}.items():
        assert done.returncode == 0, (choice, done.stderr)
        assert "[tool_calls;" in done.stderr, (choice, done.stderr)
        lines[choice] = line = json.loads(done.stdout.splitlines()[-1])
        assert line["index"] == 0 and line["finish_reason"] == "tool_calls", (choice, line)
        for call in line["tool_calls"]:
            assert call["id"].startswith("call_") and call["name"] == "get_weather", (choice, call)
            jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
    assert lines["required"]["content"] == expected.content
    assert [(c["name"], c["arguments"]) for c in lines["required"]["tool_calls"]] == [
        (c.name, c.arguments) for c in expected.tool_calls
    ]
    assert required.stdout == expected.text + "\n" + required.stdout.splitlines()[-1] + "\n"
    assert len(lines["single"]["tool_calls"]) == 1
    assert len(lines["named"]["tool_calls"]) == 1
    no_chat = example.run(*address, "--tool", json.dumps(WEATHER_TOOL), prompt)
    assert no_chat.returncode == 2 and "--tool needs --chat" in no_chat.stderr, no_chat.stderr
    server.wait_idle()


# -- the retry policy, against the scripted fake -------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.stop()


def test_the_retry_policy_matches_the_python_clients(example: Example, fake: FakeServer) -> None:
    prompts = {scenario: f"{scenario}#{example.name}" for scenario in EXPECTED_ATTEMPTS}
    runs = example.run_all([["--address", fake.address, "--timeout", "20", p] for p in prompts.values()])
    for (scenario, p), done in zip(prompts.items(), runs, strict=True):
        assert fake.attempts(p) == EXPECTED_ATTEMPTS[scenario], (scenario, done.stderr)
        if scenario in ("unavailable-twice", "exhausted-retry-after", "ok"):
            assert done.returncode == 0 and done.stdout == TEXT + "\n", (scenario, done.stderr)
        else:
            assert done.returncode == 1, scenario
        if scenario == "broken-midstream":
            assert (
                done.stdout.startswith(PARTIAL) and "error: UNAVAILABLE: data plane went away" in done.stderr
            )
        if scenario.startswith("exhausted-") and done.returncode:
            assert "error: RESOURCE_EXHAUSTED: admission queue is full" in done.stderr


# -- embeddings and the sampling extras' flags, on a tiny model -----------------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(model, num_blocks=64, max_model_len=256, block_size=4), model)
    yield srv
    srv.close()


@pytest.mark.parametrize("language", ["go", "java"])
def test_embed_and_sampling_extra_flags(
    language: str, request: pytest.FixtureRequest, tiny_server: ServerThread
) -> None:
    """--embed prints the Python client's vector (the Embed RPC, --pooling); --min-tokens and
    --truncate-prompt-tokens reach the server (a bad one gets its INVALID_ARGUMENT)."""
    prompt = "Hello world, the capital of France is Paris."
    with GenerationClient(tiny_server.grpc_address, timeout=60) as client:
        (expected,) = client.embed(prompt, pooling="mean")
        (greedy,) = client.generate(
            prompt, max_tokens=4, temperature=0.0, min_tokens=4, truncate_prompt_tokens=3
        )
    generate = request.getfixturevalue(f"{language}_bin") / "pagedserve-generate"
    example = Example(language, [str(generate)], JAVA_ENV)
    address = ["--address", tiny_server.grpc_address]
    embedded, bad_pooling, extras, bad_min = example.run_all(
        [
            [*address, "--embed", "--pooling", "mean", prompt],
            [*address, "--embed", "--pooling", "max", prompt],
            [*address, "--max-tokens", "4", "--min-tokens", "4", "--truncate-prompt-tokens", "3", prompt],
            [*address, "--max-tokens", "2", "--min-tokens", "3", prompt],
        ]
    )
    assert embedded.returncode == 0, embedded.stderr
    assert json.loads(embedded.stdout) == pytest.approx(expected, abs=1e-6)
    assert bad_pooling.returncode == 2 and "pooling must be last, mean or cls" in bad_pooling.stderr
    assert extras.returncode == 0, extras.stderr
    assert extras.stdout == greedy.text + "\n"
    assert bad_min.returncode == 1 and "sampling_params.min_tokens" in bad_min.stderr, bad_min.stderr
    tiny_server.wait_idle()
