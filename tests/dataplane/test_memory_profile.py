"""GPU memory planning, on the CPU: the worst-case batch, the profile's code path through the
real model (memory figures from a scripted fake of torch.cuda's), and the budget arithmetic.
Nothing here needs a GPU; benchmarks/src/pagedserve/benchmarks/gpu_check.sh is where the CUDA path runs."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks.tiny_models import tiny_config
from pagedserve.dataplane import LLM
from pagedserve.dataplane.kvcache.budget import plan_gpu_memory
from pagedserve.dataplane.runner import memory_profile
from pagedserve.dataplane.runner.memory_profile import (
    PROFILE_SAMPLING,
    dummy_scheduler_output,
    profile_activation_peak,
    worst_case_seq_lens,
)
from pagedserve.dataplane.runner.model_runner import ModelRunner

GiB = 2**30


class FakeStats:
    """torch.cuda's figures, scripted: the device has `total` bytes; torch's allocator holds
    `reserved`; `non_torch` bytes outside torch's allocator grow by `non_torch_growth` during
    the step (as cuBLAS handles would); the step allocates `step_peak` above the baseline."""

    def __init__(self, total: int, reserved: int, non_torch: int, non_torch_growth: int, step_peak: int):
        self.total, self.reserved, self.non_torch = total, reserved, non_torch
        self.non_torch_growth, self.step_peak = non_torch_growth, step_peak
        self.baseline = 3 * GiB
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def mem_get_info(self) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.total - self.reserved - self.non_torch, self.total

    def memory_allocated(self) -> int:
        self.calls.append("memory_allocated")
        return self.baseline

    def memory_reserved(self) -> int:
        return self.reserved

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.non_torch += self.non_torch_growth  # the step's libraries load after the reset

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        return self.baseline + self.step_peak


def load(path: Path) -> Any:
    from pagedserve.dataplane.runner.model_loader import load_model

    return load_model(path, "float32", "cpu")


# -- the worst-case batch ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "seqs", "model_len", "expected"),
    [
        (2048, 64, 4096, [32] * 64),  # the defaults: 64 sequences of 32 tokens
        (10, 4, 100, [3, 3, 2, 2]),  # the remainder goes to the first sequences
        (5, 64, 100, [1] * 5),  # fewer tokens than sequences: one token each
        (1000, 2, 300, [300, 300]),  # max_model_len caps what the sequences can hold
    ],
)
def test_worst_case_seq_lens(tokens: int, seqs: int, model_len: int, expected: list[int]) -> None:
    assert worst_case_seq_lens(tokens, seqs, model_len) == expected


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len"])
def test_worst_case_seq_lens_names_a_bad_field(field: str) -> None:
    values = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "max_model_len": 8, field: 0}
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        worst_case_seq_lens(**values)


def test_dummy_batch_computes_every_sequence_whole_on_consecutive_blocks() -> None:
    out, num_blocks = dummy_scheduler_output([5, 4, 1], block_size=4, vocab_size=7)
    assert num_blocks == 2 + 1 + 1
    assert [s.request.block_table for s in out.scheduled] == [[0, 1], [2], [3]]
    assert [s.num_new_tokens for s in out.scheduled] == [5, 4, 1]
    assert all(s.samples for s in out.scheduled)  # one sampled row per sequence: LM head + sampler
    assert out.scheduled[0].request.prompt_token_ids == [0, 1, 2, 3, 4]
    assert out.scheduled[1].request.prompt_token_ids == [1, 2, 3, 4]
    assert max(t for s in out.scheduled for t in s.request.prompt_token_ids) < 7
    assert out.num_batched_tokens == 10
    params = out.scheduled[0].request.sampling_params
    assert params is PROFILE_SAMPLING and not params.greedy and params.needs_logprobs


# -- the profile's code path on the CPU ----------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_profile_runs_the_step_and_frees_its_pool(
    tiny: Path, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    runners: list[weakref.ref[Any]] = []

    class RecordingRunner(ModelRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            runners.append(weakref.ref(self))

    monkeypatch.setattr(memory_profile, "ModelRunner", RecordingRunner)
    stats = FakeStats(
        total=80 * GiB, reserved=4 * GiB, non_torch=GiB // 2, non_torch_growth=GiB // 8, step_peak=GiB
    )
    model = load(tiny)
    profile = profile_activation_peak(
        model,
        max_num_batched_tokens=37,
        max_num_seqs=8,
        max_model_len=256,
        block_size=4,
        kv_dtype=kv_dtype,
        device=torch.device("cpu"),
        stats=stats,
    )
    cfg = tiny_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # 8 sequences of 5,5,5,5,5,4,4,4 tokens: 2 blocks of 4 tokens for a 5, 1 for a 4.
    num_blocks = 5 * 2 + 3 * 1
    element = torch.empty(0, dtype=kv_dtype).element_size()
    assert profile.num_seqs == 8
    assert profile.num_tokens == 37
    assert profile.profile_pool_bytes == (
        2 * cfg.num_hidden_layers * num_blocks * 4 * cfg.num_key_value_heads * head_dim * element
    )
    assert profile.activation_peak_bytes == GiB
    assert profile.non_torch_bytes == GiB // 8
    assert profile.total_bytes == 80 * GiB
    assert profile.free_bytes == 80 * GiB - 4 * GiB - GiB // 2 - GiB // 8
    # The baseline is read with the pool in place, the peak reset just before the step, and the
    # cache emptied before the figures after it are read.
    calls = stats.calls
    i = calls.index("memory_allocated")
    assert calls[i + 1] == "reset_peak_memory_stats"
    assert calls.index("max_memory_allocated") > i + 1
    after = calls[calls.index("max_memory_allocated") :]
    assert after.index("empty_cache") < after.index("mem_get_info")
    # The temporary runner and its pool are gone.
    assert len(runners) == 1 and runners[0]() is None


# -- the arithmetic --------------------------------------------------------------------------------
def test_plan_gpu_memory_subtracts_every_term() -> None:
    plan = plan_gpu_memory(
        total_bytes=80 * GiB,
        gpu_memory_utilization=0.9,
        weight_bytes=16 * GiB,
        activation_peak_bytes=3 * GiB,
        non_torch_bytes=GiB,
        free_bytes=60 * GiB,
    )
    assert plan.kv_memory_bytes == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - GiB
    assert not plan.capped_by_free
    assert plan.log_fields() == {
        "total": 80 * GiB,
        "gpu_memory_utilization": 0.9,
        "weights": 16 * GiB,
        "activation_peak": 3 * GiB,
        "activation_source": "profiled",
        "non_torch": GiB,
        "free": 60 * GiB,
        "kv_bytes": plan.kv_memory_bytes,
        "capped_by_free": False,
    }


def test_plan_gpu_memory_keeps_room_for_activations_when_another_process_holds_memory() -> None:
    # 90 % of 80 GiB minus 20 GiB would be 52 GiB, but only 30 GiB are free: 30 - 3 for the step.
    plan = plan_gpu_memory(80 * GiB, 0.9, 16 * GiB, 3 * GiB, GiB, 30 * GiB)
    assert plan.kv_memory_bytes == 27 * GiB
    assert plan.capped_by_free


def test_plan_gpu_memory_errors_name_the_cause() -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.2 leaves no memory"):
        plan_gpu_memory(80 * GiB, 0.2, 16 * GiB, 3 * GiB, 0, 60 * GiB)
    with pytest.raises(ValueError, match="only 2147483648 bytes of device memory are free"):
        plan_gpu_memory(80 * GiB, 0.9, 16 * GiB, 3 * GiB, 0, 2 * GiB)


# -- the engine's GPU planning, its CUDA calls replaced by the fake --------------------------------
def test_engine_plans_gpu_memory_from_the_profile(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.dataplane.engine import startup

    llm = LLM(str(tiny), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    engine = llm.engine
    stats = FakeStats(total=8 * GiB, reserved=2**28, non_torch=0, non_torch_growth=2**20, step_peak=2**27)
    monkeypatch.setattr(startup, "CudaMemoryStats", lambda device: stats)
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    plan, fields = startup.plan_device_memory(
        engine.config, engine.runner.model, torch.device("cpu"), engine.max_model_len
    )
    assert plan.activation_source == "profiled"
    assert plan.weight_bytes == weights
    assert plan.activation_peak_bytes == 2**27
    assert plan.non_torch_bytes == 2**20
    assert plan.kv_memory_bytes == int(8 * GiB * 0.9) - weights - 2**27 - 2**20
    assert fields["profile_seqs"] == 4 and fields["profile_tokens"] == 32
    assert fields["activation_estimate"] > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # the real pool was not touched


def test_engine_falls_back_to_the_estimate_when_the_profile_runs_out_of_memory(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedserve.dataplane.engine import startup

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    llm = LLM(str(tiny), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    engine = llm.engine
    monkeypatch.setattr(startup, "profile_activation_peak", out_of_memory)
    monkeypatch.setattr(startup, "CudaMemoryStats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (15 * GiB // 2, 8 * GiB))
    plan, fields = startup.plan_device_memory(
        engine.config, engine.runner.model, torch.device("cpu"), engine.max_model_len
    )
    assert plan.activation_source == "estimated"
    assert plan.activation_peak_bytes == fields["activation_estimate"]
    assert plan.free_bytes == 15 * GiB // 2
    weights = plan.weight_bytes
    assert plan.kv_memory_bytes == int(8 * GiB * 0.9) - weights - fields["activation_estimate"]
