"""Runs the `bench quantized` workload on llama.cpp (llama-cpp-python); executed by the peer
venv's own interpreter (benchmarks/src/pagedserve/benchmarks/llamacpp_env.py).

    <llama-cpp-venv>/bin/python benchmarks/src/pagedserve/benchmarks/llamacpp_peer.py JOB.json RESULT.json

JOB: {"gguf": path, "threads": n, "runs": {name: {"prompts": [[token ids]], "max_tokens": n}},
"prompt_lookup": k (optional: prompt-lookup decoding drafting k tokens), "n_ctx": n (optional),
"stop_at_eos": true (optional: end a prompt's output at its end-of-sequence token)}.
RESULT: {"version", "load_seconds", "runs": {name: {"seconds", "outputs": [[token ids]]}}}.
Greedy (top_k 1), each prompt's tokens fed as ids (the same ids our engine gets), exactly
`max_tokens` new tokens per prompt (the generator does not stop at end of sequence), one
prompt after the other: the binding serves one sequence at a time. Imports nothing from
pagedserve.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    import llama_cpp

    with open(job_path) as f:
        job = json.load(f)
    t = time.perf_counter()
    draft = None
    if job.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=int(job["prompt_lookup"]))
    llm = llama_cpp.Llama(
        model_path=job["gguf"],
        n_ctx=int(job.get("n_ctx", 4096)),
        n_batch=512,
        n_threads=int(job["threads"]),
        verbose=False,
        seed=0,
        draft_model=draft,
        logits_all=draft is not None,  # verifying drafts reads every position's logits
    )
    load_s = time.perf_counter() - t

    def generate(prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if job.get("stop_at_eos") and int(token) == llm.token_eos():
                break
            out.append(int(token))
            if len(out) == n:
                break
        return out

    generate(job["runs"][next(iter(job["runs"]))]["prompts"][0], 4)  # warm-up
    runs = {}
    for name, run in job["runs"].items():
        t = time.perf_counter()
        outputs = [generate(p, int(run["max_tokens"])) for p in run["prompts"]]
        runs[name] = {"seconds": time.perf_counter() - t, "outputs": outputs}
    with open(result_path, "w") as f:
        json.dump({"version": llama_cpp.__version__, "load_seconds": load_s, "runs": runs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
