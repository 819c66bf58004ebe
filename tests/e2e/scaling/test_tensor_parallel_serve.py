"""`pagedserve serve --tensor-parallel-size 2` as an operator meets it: the data plane runs two
ranks (gloo) and serves the gRPC and OpenAI APIs with the tokens of an unsplit engine; killing
its worker ends the data plane with one clear error line, the control plane marks it
unavailable (/health 503), and `serve` restarts it with a new worker.

The model: a tiny random-weight Llama with the default model's vocabulary and tokenizer (the
OpenAI routes need text), 4 query / 2 KV heads so that two ranks split it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from pagedserve.benchmarks.tiny_models import tiny_config
from pagedserve.clients.python import GenerationClient
from pagedserve.common.models import DEFAULT_MODEL, resolve_model_path
from pagedserve.dataplane import LLM, SamplingParams
from tests.e2e.harness import wait_until
from tests.e2e.lifecycle.test_process_lifecycle import LOG_NOISE, Serve, generates, gone, http_status

pytestmark = pytest.mark.real_model  # the default model's tokenizer

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    real = resolve_model_path(DEFAULT_MODEL)
    directory = tmp_path_factory.mktemp("tp-llama")
    torch.manual_seed(0)
    # SmolLM2's vocabulary (its tokenizer serves the text routes), tied embeddings like it.
    config = tiny_config("llama", vocab_size=49152, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def offline(model: Path) -> dict[str, Any]:
    """The unsplit engine's greedy tokens (and text) for the prompts the servers get."""
    llm = LLM(str(model), num_threads=1, max_model_len=256, num_gpu_blocks_override=32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts: list[str | list[int]] = [PROMPT_IDS, TEXT]
    ids, text = llm.generate(prompts, params, use_tqdm=False)
    return {"ids": ids.token_ids, "text": text.text}


@pytest.fixture(scope="module")
def serving(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    srv = Serve(model, tmp_path_factory.mktemp("serve-tp"), "tp2", "--tensor-parallel-size", "2")
    try:
        srv.wait_serving()
        yield srv
    finally:
        srv.cleanup()
        for pid in worker_pids(srv):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def worker_pids(srv: Serve) -> list[int]:
    """The tensor-parallel workers: the children of the live data-plane child(ren)."""
    pids: list[int] = []
    for parent in srv.child_pids():
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
    return pids


def test_grpc_and_openai_serve_the_unsplit_tokens(
    serving: Serve, offline: dict[str, Any], model: Path
) -> None:
    assert len(worker_pids(serving)) == 1  # rank 1, started by the data plane (rank 0)
    with GenerationClient(serving.grpc_address, timeout=60) as client:
        (done,) = client.generate(PROMPT_IDS, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert done.token_ids == offline["ids"]
    assert done.completion_tokens == 8

    api = openai.OpenAI(base_url=f"{serving.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    completion = api.completions.create(
        model=str(model), prompt=TEXT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == offline["text"]
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    chat = api.chat.completions.create(
        model=str(model), messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert http_status(f"{serving.http_url}/health") == 200


def test_a_killed_worker_ends_the_data_plane_with_a_clear_error(serving: Serve) -> None:
    (child,) = serving.child_pids()
    (worker,) = worker_pids(serving)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: gone(child), 30, "the data plane exited after its worker died")
    wait_until(lambda: http_status(f"{serving.http_url}/health") == 503, 10, "/health 503 while it is down")
    message = f"tensor-parallel worker rank 1 died (exit code {-signal.SIGKILL}); the data plane exits"
    errors = [line for line in serving.stderr.splitlines() if line.startswith("pagedserve: error:")]
    assert errors == [f"pagedserve: error: {message}"], serving.stderr[-3000:]
    # `serve` restarts the data plane, which starts a new worker.
    serving.wait_for(r"starting the data plane \(pid \d+\)", timeout_s=60, count=2)
    wait_until(lambda: generates(serving.grpc_address), 120, "serving again with a new worker")
    assert len(worker_pids(serving)) == 1 and worker not in worker_pids(serving)
    assert time.monotonic() - killed < 180
    assert serving.proc.poll() is None
    assert not any(noise in serving.stderr for noise in LOG_NOISE), serving.stderr[-3000:]
