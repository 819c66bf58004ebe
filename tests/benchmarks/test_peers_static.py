"""benchmarks/src/pagedserve/benchmarks/peers.py's static-batching transformers peer on a tiny random Llama: the CPU/fp32
defaults and the explicit device/dtype keywords (what gpu_check passes, there "cuda" and bf16)
give the same tokens, which are transformers' own greedy ones, each cut to its request's length."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.benchmarks.peers import run_transformers_static, static_steps
from pagedserve.benchmarks.tiny_models import (
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
)

# Two batches of two: the first left-pads its 3-token prompt to 7, the second runs 5 tokens for
# a request that wants 2.
PROMPTS = [[5, 17, 33, 101, 7, 250, 9], [44, 12, 300], [8, 8, 120, 64, 31], [77, 3, 210, 15]]
LENGTHS = [4, 3, 5, 2]


def test_explicit_cpu_fp32_gives_the_default_calls_greedy_tokens(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path)
    default = run_transformers_static(path, PROMPTS, LENGTHS, batch_size=2)
    explicit = run_transformers_static(
        path, PROMPTS, LENGTHS, batch_size=2, device="cpu", dtype=torch.float32
    )
    assert explicit.outputs == default.outputs
    assert [len(o) for o in default.outputs] == LENGTHS
    assert default.name == explicit.name == "transformers generate, static batch 2"
    # Rows generated past their own length count; padding counts at each batch's longest prompt.
    assert default.details["generated_tokens"] == explicit.details["generated_tokens"] == 2 * 4 + 2 * 5
    assert default.details["padded_prompt_tokens"] == 2 * 7 + 2 * 5
    assert len(default.details["batch_seconds"]) == 2
    ref_model = load_reference_model(path)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        assert_same_greedy(default.outputs[i], reference_greedy(ref_model, prompt, n), f"prompt {i}")


class _Counter:
    def __init__(self) -> None:
        self.n, self.closed = 0, False

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_the_step_bar_moves_once_per_decode_step_of_every_batch(tmp_path: Path) -> None:
    # One big batch must still show progress: the bar ticks per generated position.
    path = make_tiny_model("llama", tmp_path)
    bar = _Counter()
    run = run_transformers_static(path, PROMPTS, LENGTHS, batch_size=2, step_bar=bar)
    assert bar.n == static_steps(LENGTHS, 2) == 4 + 5 and bar.closed
    assert [len(o) for o in run.outputs] == LENGTHS
