"""`pagedserve serve --model SmolLM2-135M-Instruct-Q4_1`: the default model's GGUF file served
quantized, end to end through both planes: the Python gRPC client and the official OpenAI
client get the offline engine's greedy tokens, and the data plane holds the quantized weights."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest

from pagedserve.clients.python import GenerationClient
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.dataplane import LLM, SamplingParams
from tests.e2e.harness import Process

pytestmark = pytest.mark.real_model

MODEL = f"{DEFAULT_MODEL}-Q4_1"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 16


@pytest.fixture(scope="module")
def offline() -> tuple[list[int], str]:
    llm = LLM(MODEL, num_threads=1, kv_cache_memory=64 << 20)
    out = llm.chat(CHAT, SamplingParams(max_tokens=TOKENS, temperature=0), use_tqdm=False)[0]
    return list(out.token_ids), out.outputs[0].text


@pytest.fixture(scope="module")
def server(offline: tuple[list[int], str]) -> Iterator[Process]:
    argv = ["serve", "--model", MODEL, "--grpc-port", "0", "--http-port", "0", "--dataplane-port", "0"]
    proc = Process([*argv, "--threads", "1", "--kv-cache-memory", "64MiB"], "gRPC on ")
    yield proc
    proc.kill(signal.SIGINT)


def test_grpc_and_openai_clients_get_the_offline_tokens(
    server: Process, offline: tuple[list[int], str]
) -> None:
    import openai

    tokens, text = offline
    with GenerationClient(server.address, timeout=60) as client:
        out = client.generate(CHAT, max_tokens=TOKENS, temperature=0.0)[0]
        assert list(out.token_ids) == tokens
        # (int8 activations answer "L'Étoile, ..." here, as llama.cpp does on this file; the
        # float32 path "The capital of France is Paris.": the first token is a near tie)
        assert out.text == text and len(text) > 10
        assert client.list_models() == [MODEL]
    http_port = server.line.split("HTTP on http://", 1)[1].split(":")[1].strip()
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused")
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0.0)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == out.text
    assert reply.usage is not None and reply.usage.completion_tokens == len(tokens)
    # the data plane's start-up log: the packed weights' bytes, 0.22x the fp32 model's 651 MB
    kernels = next(json.loads(line) for line in server.stderr().splitlines() if '"phase": "kernels"' in line)
    assert 100e6 < kernels["weight_bytes"] < 0.4 * 651e6
