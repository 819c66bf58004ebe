"""End-to-end on the real default model (SmolLM2-135M-Instruct, fp32): greedy tokens equal
transformers' own generate, and the chat path answers sensibly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks.tiny_models import assert_same_greedy, reference_greedy
from pagedserve.dataplane import LLM, SamplingParams

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What does a paged KV cache do in an LLM inference server?",
    "Give me a short recipe for pancakes.",
    "Who wrote Romeo and Juliet, and when?",
    "Summarise the plot of Cinderella in one sentence.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> LLM:
    return LLM(str(default_model_path), max_model_len=1024, kv_cache_memory=256 * 2**20, num_threads=2)


def test_greedy_matches_transformers_on_chat_prompts(llm: LLM, default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    ref_model: Any = AutoModelForCausalLM.from_pretrained(
        default_model_path, dtype=torch.float32, attn_implementation="sdpa"
    )
    ref_model.generation_config.eos_token_id = None
    exact = 0
    for q, prompt, out in zip(QUESTIONS, prompts, outs, strict=True):
        ref = reference_greedy(ref_model.eval(), prompt, NEW_TOKENS)
        exact += assert_same_greedy(out.token_ids, ref, q)
    assert exact >= len(QUESTIONS) - 1
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_chat_answers_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0.0)
    )
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`pagedserve ARGS...` in a fresh interpreter, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "pagedserve", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_generate(default_model_path: Path) -> None:
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_cli_chat_reads_stdin(default_model_path: Path) -> None:
    proc = run_cli("chat", "--max-tokens", "32", stdin="What is the capital of France?\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_cli_missing_model_names_the_pull_command(tmp_path: Path) -> None:
    proc = run_cli("generate", "hi", "--model-home", str(tmp_path))
    assert proc.returncode == 1
    assert "pagedserve models pull SmolLM2-135M-Instruct" in proc.stderr
