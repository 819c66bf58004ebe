"""`pagedserve serve` on the real default model: streamed text equals the offline engine's
greedy output; chat, stop strings, n > 1, tokenize/detokenize, health and reflection; the CLI
client prints the text; Ctrl-C stops both processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.dataplane import LLM, SamplingParams
from tests.e2e.harness import REPO, Process

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 24
# A model named by path, as vLLM serves a local folder: what many clients written for vLLM send.
PATH_MODEL_NAME = "/models/llama-7b-hf"

# A typical streaming client written for vLLM's OpenAI server, verbatim but for the port.
VLLM_STYLE_CLIENT = """
import openai
client = openai.Client(base_url="http://localhost:8000/v1", api_key="dummy")

response = client.chat.completions.create(
    model="/models/llama-7b-hf",
    messages=[{"role": "user", "content": "解释KV Cache的工作原理"}],
    temperature=0.7,
    max_tokens=512,
    stream=True,  # 流式输出降低首token延迟
)
for chunk in response:
    if chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="")
"""


@pytest.fixture(scope="module")
def offline(default_model_path: Path) -> dict[str, list[int]]:
    llm = LLM(DEFAULT_MODEL, num_threads=1)
    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    return {**{p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)}, "chat": chat.token_ids}


@pytest.fixture(scope="module")
def server(offline: dict[str, list[int]]) -> Iterator[Process]:
    proc = Process(
        [
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--dataplane-port",
            "0",
            "--threads",
            "1",
            "--served-model-name",
            DEFAULT_MODEL,
            PATH_MODEL_NAME,
        ],
        "gRPC on ",
    )
    yield proc
    proc.kill(signal.SIGINT)


def test_control_plane_tokenizer_matches_transformers(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer(default_model_path)
    theirs = AutoTokenizer.from_pretrained(default_model_path)
    text = ours.apply_chat_template(CHAT)
    assert text == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for s in [text, *PROMPTS, "naïve café — 東京 🙂"]:
        assert ours.encode(s) == theirs.encode(s, add_special_tokens=False)
        expected = theirs.decode(theirs.encode(s, add_special_tokens=False), skip_special_tokens=True)
        assert ours.decode(ours.encode(s)) == expected


def test_streamed_text_equals_the_offline_engine(
    server: Process, offline: dict[str, list[int]], default_model_path: Path
) -> None:
    tokenizer = Tokenizer(default_model_path)

    async def run() -> None:
        async with AsyncGenerationClient(server.address) as client:
            results = await asyncio.gather(
                *(client.generate(p, max_tokens=TOKENS, temperature=0.0) for p in PROMPTS),
                client.generate(CHAT, max_tokens=TOKENS, temperature=0.0),
            )
            for key, result in zip([*PROMPTS, "chat"], results, strict=True):
                assert result[0].token_ids == offline[key], key
                assert result[0].text == tokenizer.decode(offline[key]), key
            assert "Paris" in results[-1][0].text

            # A repeated prompt is served from the prefix cache (SmolLM2's system prompt is 2+ blocks).
            again = await client.generate(CHAT, max_tokens=TOKENS, temperature=0.0)
            assert again[0].token_ids == offline["chat"]
            assert again[0].cached_tokens >= 32

    asyncio.run(run())


def test_stop_strings_n_and_seeds(
    server: Process, offline: dict[str, list[int]], default_model_path: Path
) -> None:
    tokenizer = Tokenizer(default_model_path)
    full = tokenizer.decode(offline[PROMPTS[2]])
    stop = full.split()[3]  # a word inside the greedy continuation
    with GenerationClient(server.address, timeout=60) as client:
        out = client.generate(PROMPTS[2], max_tokens=TOKENS, temperature=0.0, stop=[stop])[0]
        assert out.finish_reason == "stop" and out.stop_string == stop
        assert out.text == full[: full.index(stop)]
        samples = client.generate(PROMPTS[0], max_tokens=8, temperature=0.9, seed=7, n=3)
        assert [s.index for s in samples] == [0, 1, 2]
        assert all(s.completion_tokens == 8 for s in samples)
        again = client.generate(PROMPTS[0], max_tokens=8, temperature=0.9, seed=7, n=3)
        assert [s.token_ids for s in again] == [s.token_ids for s in samples]
        assert len({tuple(s.token_ids) for s in samples}) > 1
        ids = client.tokenize(PROMPTS[0])
        assert ids == tokenizer.encode(PROMPTS[0])
        assert client.detokenize(ids) == PROMPTS[0]
        assert client.list_models() == [DEFAULT_MODEL, PATH_MODEL_NAME]


def test_health_and_reflection(server: Process) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(
            health_pb2.HealthCheckRequest(service="pagedserve.v1.GenerationService"), timeout=5
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"pagedserve.v1.GenerationService", "grpc.health.v1.Health"} <= names
        assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
        # grpc.reflection.v1 (current grpcurl and Postman) answers too: same messages, new name.
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        request = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="pagedserve.v1.GenerationService"
        )
        (response,) = list(v1(iter([request]), timeout=5))
        files = response.file_descriptor_response.file_descriptor_proto
        assert any(b"pagedserve/v1/generation.proto" in f for f in files)


def test_cli_client_prints_the_text(
    server: Process, offline: dict[str, list[int]], default_model_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "pagedserve", "client", "generate", "--address", server.address]
    done = subprocess.run(
        [*argv, "--max-tokens", str(TOKENS), PROMPTS[1]], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == Tokenizer(default_model_path).decode(offline[PROMPTS[1]]) + "\n"
    streamed = subprocess.run(
        [*argv, "--stream", "--max-tokens", str(TOKENS), PROMPTS[1]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert streamed.stdout == done.stdout
    bad = subprocess.run(
        [*argv, "--temperature", "-1", "x"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr


def test_a_vllm_style_openai_client_works_unchanged(server: Process) -> None:
    http_port = server.line.split("HTTP on http://", 1)[1].split(":")[1].strip()
    code = VLLM_STYLE_CLIENT.replace("localhost:8000", f"localhost:{http_port}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) > 20, done.stdout


def test_ctrl_c_stops_both_processes(server: Process) -> None:
    # Find the data-plane child before stopping the parent.
    children = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) == 1
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.proc.wait(timeout=30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(int(children[0]), 0)
