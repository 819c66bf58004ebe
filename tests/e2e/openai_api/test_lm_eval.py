"""`lm-eval --model local-completions` (its loglikelihood requests: echo, logprobs 1, token-id
prompts) scores a five-item multiple-choice task shipped here (lm_eval_task/) against a tiny
served model: each item's per-choice loglikelihoods equal transformers' fp32 ones within 1e-4,
and so does the accuracy. Runs offline; skipped where lm-eval is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.benchmarks.tiny_models import load_reference_model
from tests.e2e.hardening.tiny_served import make_tiny_served_model
from tests.e2e.harness import ServerThread, engine_config

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]: its API models need it

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "pagedserve_tiny_mc"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(model, num_blocks=128, max_model_len=512, block_size=4), model)
    yield srv
    idle = srv.wait_idle()
    assert idle.snapshot.stats.free_blocks == idle.snapshot.stats.total_blocks
    srv.close()


def encode_pair(tokenizer: object, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's own split of a (context, continuation) pair into token ids (trailing spaces
    of the context move to the continuation; the whole is encoded, then cut)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)  # type: ignore[attr-defined]
    ctx = tokenizer.encode(context, add_special_tokens=False)  # type: ignore[attr-defined]
    return ctx, whole[len(ctx) :]


@torch.inference_mode()
def reference_loglikelihood(ref_model: object, ctx: list[int], cont: list[int]) -> float:
    ids = ctx + cont
    logits = ref_model(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]
    logprobs = logits.log_softmax(dim=-1)
    return sum(float(logprobs[p - 1, ids[p]]) for p in range(len(ctx), len(ids)))


def test_lm_eval_local_completions_matches_transformers(
    server: ServerThread, model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    out_dir = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    model_args = (
        f"base_url={server.http_url}/v1/completions,model=llama,tokenizer={model},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            TASK,
            "--include_path",
            str(TASK_DIR),
            "--output_path",
            str(out_dir),
            "--log_samples",
        ],
        cwd=TASK_DIR,  # the task's data_files are relative to it
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    samples = [json.loads(line) for path in out_dir.rglob(f"samples_{TASK}_*.jsonl") for line in path.open()]
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    assert len(samples) == 5

    tokenizer = AutoTokenizer.from_pretrained(model)
    ref_model = load_reference_model(model)
    correct = 0
    for sample in samples:
        ours = [float(r[0][0]) for r in sample["resps"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        expected = [reference_loglikelihood(ref_model, *encode_pair(tokenizer, *pair)) for pair in pairs]
        assert ours == pytest.approx(expected, abs=1e-4), sample["doc"]
        right = max(range(len(expected)), key=expected.__getitem__) == sample["doc"]["answer"]
        assert sample["acc"] == float(right), sample["doc"]
        correct += right
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(samples))
