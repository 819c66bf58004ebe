"""The GPU check's steps that run in its own process (`benchmarks/src/pagedserve/benchmarks/gpu_check.py` plans, runs and
summarizes them): greedy exactness against transformers on the tiny Llama, and throughput on a
random-weight Llama-3.2-1B-shaped model."""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Greedy divergences accepted as numerical ties: the reference's top-2 margin, relative to its top
# logit. fp32 as the CPU exactness tests (benchmarks/src/pagedserve/benchmarks/tiny_models.py); bf16 keeps 8 mantissa
# bits, so two implementations that round intermediate results at different places differ by a
# few bf16 ulps (2^-8 relative each).
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


# Of the 32 prompts, how many may end in a tie: 2 in fp32 (as tests/dataplane/test_engine_exactness.py),
# a quarter in bf16, whose coarse logits tie far more often.
MAX_TIES = {"float32": 2, "bfloat16": 8}


EXACTNESS_CASES: dict[str, dict[str, Any]] = {
    # Sized by the memory planning (a small share: the tiny model needs little), so it runs on CUDA.
    "batched": {"block_size": 16, "max_num_seqs": 32, "gpu_memory_utilization": 0.01, "swap_space": 1 / 16},
    # 24 blocks of 4 tokens: the longest request (70 + 20 tokens) fits alone, 32 at once do not.
    "chunked+preempted": {
        "block_size": 4,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 64,
        "num_gpu_blocks_override": 24,
        "swap_space": 1 / 16,  # GiB of pinned host pool: plenty here, and quick to pin
    },
}


# The throughput step's own arguments, handed from the plan to its process.
THROUGHPUT_SETTINGS = (
    "num_prompts",
    "min_prompt",
    "max_prompt",
    "min_output",
    "max_output",
    "max_num_seqs",
    "max_num_batched_tokens",
    "peer_batch_size",
    "seed",
)


def llama_1b_config() -> Any:
    """Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads, vocab 128256, tied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def count_parameters(config: Any) -> int:
    """Parameters of a model built from `config` on the meta device (no memory, no GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), before reading a clock."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device: str) -> None:
    """Free what dropped objects held, before the next engine or model loads."""
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# -- step: exactness ------------------------------------------------------------------------------
def compare_greedy(ours: Sequence[int], ref_tokens: Sequence[int], ref_logits: Any, rel_tol: float) -> str:
    """ "exact", "tie" (the first divergence is the reference's runner-up within `rel_tol` of its
    top logit), or what went wrong. `ref_logits[i]` is the reference's [vocab] logits at step i."""
    if len(ours) != len(ref_tokens):
        return f"length {len(ours)} != reference {len(ref_tokens)}"
    i = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)) if a != b), None)
    if i is None:
        return "exact"
    top2 = ref_logits[i].float().topk(2)
    margin = float(top2.values[0] - top2.values[1])
    tol = rel_tol * max(1.0, abs(float(top2.values[0])))
    if ours[i] == int(top2.indices[1]) and margin < tol:
        return "tie"
    return f"token {i}: ours {ours[i]}, reference {ref_tokens[i]}, margin {margin:.3g} (tie below {tol:.3g})"


def run_exactness(device: str) -> dict[str, Any]:
    """Each EXACTNESS_CASES engine against transformers' greedy tokens, per dtype, on the 32
    prompts of the exactness workload (benchmarks/src/pagedserve/benchmarks/tiny_models.py) and its tiny random Llama."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.benchmarks.tiny_models import exactness_workload, make_tiny_model
    from pagedserve.dataplane import LLM, SamplingParams

    items = exactness_workload()
    prompts, lengths = [p for p, _ in items], [n for _, n in items]
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model("llama", Path(tmp))
        for dtype in ("float32", "bfloat16"):
            ref_model = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            ).to(torch.device(device))  # type: ignore[arg-type]  # transformers stubs type .to oddly
            ref_model.generation_config.eos_token_id = None  # like ignore_eos
            refs = []
            for prompt, n in items:
                ids = torch.tensor([prompt], device=device)
                gen = ref_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
                refs.append(
                    (gen.sequences[0, len(prompt) :].tolist(), [s[0].float().cpu() for s in gen.logits])
                )
            del ref_model
            release(device)
            for case, settings in EXACTNESS_CASES.items():
                llm = LLM(str(path), device=device, dtype=dtype, max_model_len=256, **settings)
                params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
                outs = llm.generate(prompts, params, use_tqdm=False)
                verdicts = [
                    compare_greedy(o.token_ids, tokens, logits, TIE_TOLERANCE[dtype])
                    for o, (tokens, logits) in zip(outs, refs, strict=True)
                ]
                engine = llm.engine
                engine.check_integrity()
                cases.append(
                    {
                        "dtype": dtype,
                        "case": case,
                        "settings": settings,
                        "prompts": len(prompts),
                        "exact": verdicts.count("exact"),
                        "ties": verdicts.count("tie"),
                        "mismatches": [v for v in verdicts if v not in ("exact", "tie")],
                        "blocks": engine.pool.num_blocks,
                        "leaked_blocks": engine.pool.num_blocks - engine.pool.num_free_blocks,
                        "preemptions": engine.scheduler.num_preemptions,
                    }
                )
                del llm, engine
                release(device)
    return {"cases": cases, "tie_tolerance": TIE_TOLERANCE}


def exactness_ok(result: dict[str, Any]) -> bool:
    """No mismatch, no leak, and few ties (most divergences looking like ties means a bug)."""
    return all(
        not c["mismatches"] and not c["leaked_blocks"] and c["ties"] <= MAX_TIES[c["dtype"]]
        for c in result["cases"]
    )


# -- step: throughput -----------------------------------------------------------------------------
def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids (no tokenizer: the weights are random too), lengths in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_throughput(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.benchmarks.peers import agreement, check_lengths, run_transformers_static
    from pagedserve.benchmarks.workloads import describe, output_lengths
    from pagedserve.dataplane import LLM, SamplingParams

    config = llama_1b_config()
    prompts = random_prompts(args.num_prompts, args.min_prompt, args.max_prompt, config.vocab_size, args.seed)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output, args.seed)
    useful = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        params_count = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        release(device)

        llm = LLM(
            tmp,
            device=device,
            dtype="bfloat16",
            max_model_len=args.max_prompt + args.max_output,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=0.85,
        )
        greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        llm.generate(
            prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        synchronize(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        synchronize(device)
        ours_s = time.perf_counter() - start
        ours = [o.token_ids for o in outs]
        check_lengths("engine", ours, lengths)
        blocks = llm.engine.pool.num_blocks
        del llm, outs
        release(device)

        peer = run_transformers_static(
            Path(tmp), prompts, lengths, args.peer_batch_size, device=device, dtype=torch.bfloat16
        )
    return {
        "model": {"shape": "Llama-3.2-1B", "parameters": params_count, "dtype": "bfloat16"},
        "workload": describe(prompts, lengths),
        "engine": {
            "seconds": ours_s,
            "output_tok_s": useful / ours_s,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "blocks": blocks,
        },
        "transformers_static": {
            "seconds": peer.total_seconds,
            "output_tok_s": useful / peer.total_seconds,
            "batch_size": args.peer_batch_size,
        },
        "speedup": peer.total_seconds / ours_s,
        "greedy_agreement": agreement(ours, peer.outputs),
    }
