"""Where one engine step's time goes: an op-class profile, the owned model vs transformers' layers.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench step-profile                    # = python -m pagedserve.benchmarks.step_profile

What it does, in one process:

1. Two `ModelRunner`s on `--model` (fp32, CPU, `--threads` torch threads): one as the
   engine builds it (the owned model, dataplane/src/pagedserve/dataplane/models/llama.py) and one on transformers'
   modules (`model_impl="transformers"`, served by the attention hook). Both get the same KV
   pool shape, sized for the two synthetic steps below.
2. Two synthetic `SchedulerOutput`s, the same for both runners: a decode step
   (`--decode-seqs` sequences, `--context` tokens each, one new token per sequence, every row
   sampled) and a prefill step (`--prefill-seqs` prompts of `--prefill-len` tokens). Token ids
   are seeded random draws from the vocabulary; the decode context's KV is never written
   (attention reads the same bytes whatever they hold). `execute` does not advance a request,
   so a step can be replayed.
3. Profile: for each step class and runner, after one warm-up step, `--decode-steps` /
   `--prefill-steps` steps under `torch.profiler`, with `record_function` ranges around our
   phases: the decoder's linear layers, the LM head, RMSNorm (the module, or the
   owned layers' norms, the second with the residual add it is fused with), rotary (transformers'
   `apply_rotary_pos_emb`, or the owned layers'), the activation (the module, or the owned layers' SiLU x up), the KV cache write,
   paged attention, the attention metadata and sampling. "other" is the step's wall time
   minus those (residual adds, transformers' `act * up`, views, Python). Printed
   as ms per step and share of the step. The owned layers run our C++ elementwise kernels
   (kernels/src/pagedserve/kernels/cpu/layer_ops.cpp) on the CPU in fp32, as the engine does. The engine runs each
   layer's halves around attention as one C++ op each (kernels/src/pagedserve/kernels/cpu/decoder_block.cpp), which
   no range can see into, so the profile runs those halves op by op: the same kernels in the
   same order, plus the Python between them that the block ops save (the A/B below runs the
   engine's path).
4. A/B without the profiler: `--decode-pairs` / `--prefill-pairs` paired steps, alternating
   which runner goes first; the speed-up is the median transformers-layers step time over
   the median owned-model step time.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.common import default_model, load_note, phase, warn_if_busy
from pagedserve.benchmarks.report import Report

# key -> row label, in table order; "other" is derived (the step minus every range above it).
PHASES: dict[str, str] = {
    "linear": "linear layers (q/k/v/o/gate/up/down)",
    "attention": "paged attention",
    "lm_head": "LM head",
    "rmsnorm": "RMSNorm (owned layers: with the residual add before it)",
    "rotary": "rotary (q and k)",
    "kv_write": "KV cache write",
    "activation": "activation (owned layers: SiLU x up)",
    "sampling": "sampling",
    "metadata": "attention metadata",
    "other": "other (residual adds, views, Python)",
}
VARIANTS: dict[str, str] = {"transformers": "transformers layers", "owned": "owned layers"}
STEP_RANGE = "step"
LABEL_PREFIX = "pagedserve/"  # our record_function names, apart from the profiler's own ops


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=default_model(), help="registry name or local folder")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--decode-seqs", type=int, default=64, help="sequences in the decode step")
    ap.add_argument("--context", type=int, default=500, help="tokens of each decode sequence")
    ap.add_argument("--prefill-seqs", type=int, default=4, help="prompts in the prefill step")
    ap.add_argument("--prefill-len", type=int, default=512, help="tokens of each prompt")
    ap.add_argument("--decode-steps", type=int, default=6, help="profiled decode steps per variant")
    ap.add_argument("--prefill-steps", type=int, default=2, help="profiled prefill steps per variant")
    ap.add_argument("--decode-pairs", type=int, default=20, help="A/B decode step pairs")
    ap.add_argument("--prefill-pairs", type=int, default=6, help="A/B prefill step pairs")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("threads", "block_size", "decode_seqs", "prefill_seqs", "prefill_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context < 2:  # one cached token at least, then the decoded one
        raise ValueError(f"--context must be >= 2, got {args.context}")
    for name in ("decode_steps", "prefill_steps", "decode_pairs", "prefill_pairs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def synthetic_step(
    prefix: str,
    num_seqs: int,
    length: int,
    new_tokens: int,
    first_block: int,
    block_size: int,
    vocab: int,
    seed: int,
) -> Any:
    """A SchedulerOutput computing the last `new_tokens` of `num_seqs` sequences of `length`
    tokens, each on its own run of blocks from `first_block` on."""
    from pagedserve.dataplane import SamplingParams
    from pagedserve.dataplane.request import Request
    from pagedserve.dataplane.scheduler import ScheduledRequest, SchedulerOutput

    rng = random.Random(seed)
    blocks_per_seq = -(-length // block_size)
    scheduled = []
    for i in range(num_seqs):
        tokens = [rng.randrange(vocab) for _ in range(length)]
        r = Request(f"{prefix}{i}", tokens, SamplingParams(max_tokens=1, temperature=0.0))
        r.num_computed_tokens = length - new_tokens
        start = first_block + i * blocks_per_seq
        r.block_table = list(range(start, start + blocks_per_seq))
        scheduled.append(ScheduledRequest(r, new_tokens))
    return SchedulerOutput(scheduled=scheduled)


def build_runner(model_path: Path, owned: bool, num_blocks: int, block_size: int) -> Any:
    """A fp32 CPU ModelRunner on the owned model, or (`owned=False`) on transformers' modules."""
    import torch

    from pagedserve.dataplane.config import ModelConfig
    from pagedserve.dataplane.runner.model_loader import load_model
    from pagedserve.dataplane.runner.model_runner import ModelRunner

    model = load_model(model_path, "float32", "cpu", model_impl="pagedserve" if owned else "transformers")
    return ModelRunner(model, ModelConfig(), num_blocks, block_size, torch.float32)


@contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    """Set `target.name` for the block; restore it (or drop an instance attribute) after."""
    had_own = name in vars(target)
    old = vars(target).get(name)
    setattr(target, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(target, name, old)
        else:
            delattr(target, name)


def _labelled(fn: Callable[..., Any], key: str, open_keys: set[str]) -> Callable[..., Any]:
    """fn inside a `key` range, unless a `key` range is open already (the owned layers' torch
    fallbacks call the activation module inside silu_and_mul): a nested range of the same
    key would count its time twice."""
    from torch.profiler import record_function

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if key in open_keys:
            return fn(*args, **kwargs)
        open_keys.add(key)
        try:
            with record_function(LABEL_PREFIX + key):
                return fn(*args, **kwargs)
        finally:
            open_keys.discard(key)

    return wrapper


@contextmanager
def phase_ranges(runner: Any) -> Iterator[None]:
    """Wrap the runner's phases in `record_function` ranges for the block (and unwrap after,
    so the A/B runs without them). The module-level functions are patched where they are
    looked up: models.attention for the KV write and attention, model_runner for metadata and
    sampling, models.llama for the owned layers' elementwise work."""
    from torch import nn

    import pagedserve.dataplane.models.attention as attention
    import pagedserve.dataplane.models.llama as llama
    import pagedserve.dataplane.runner.model_runner as model_runner
    from pagedserve.dataplane.runner.cpu_linear import PackedLinear, PanelLinear
    from pagedserve.dataplane.runner.quant_linear import QuantLinear, QuantPanelLinear

    functions = [
        (attention, "write_kv_cache", "kv_write"),
        (attention, "paged_attention", "attention"),
        (model_runner, "build_attention_metadata", "metadata"),
        (model_runner, "sample", "sampling"),
        (llama, "rms_norm", "rmsnorm"),
        (llama, "input_rms_norm", "rmsnorm"),
        (llama, "add_rms_norm", "rmsnorm"),
        (llama, "apply_rotary", "rotary"),
        (llama, "silu_and_mul", "activation"),
    ]
    # transformers' layers look apply_rotary_pos_emb up in their modeling module.
    for m in runner.model.modules():
        modeling = sys.modules.get(type(m).__module__)
        if (
            modeling is not None
            and type(m).__name__.endswith("Attention")
            and hasattr(modeling, "apply_rotary_pos_emb")
        ):
            functions.append((modeling, "apply_rotary_pos_emb", "rotary"))
            break
    open_keys: set[str] = set()
    with ExitStack() as stack:
        # The block ops (one C++ call per layer half) hide the phases: run the halves op by op.
        for layer in runner.model.modules():
            if isinstance(layer, llama.LlamaDecoderLayer):
                stack.enter_context(_patched(layer, "attention_input_args", None))
                stack.enter_context(_patched(layer, "mlp_args", None))
        for module, name, key in functions:
            stack.enter_context(_patched(module, name, _labelled(getattr(module, name), key, open_keys)))
        for m in runner.model.modules():
            kind = type(m).__name__
            if m is runner.model.output_embeddings():
                key = "lm_head"
            elif isinstance(m, nn.Linear | PackedLinear | PanelLinear | QuantLinear | QuantPanelLinear):
                key = "linear"
            elif kind.endswith("RMSNorm"):
                key = "rmsnorm"
            elif isinstance(m, nn.SiLU) or kind.endswith("Activation"):
                key = "activation"
            else:
                continue
            stack.enter_context(_patched(m, "forward", _labelled(m.forward, key, open_keys)))
        yield


def profile_steps(runner: Any, step: Any, num_steps: int) -> dict[str, Any]:
    """ms per step of each phase (and the step), and each phase's share of the step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with phase_ranges(runner):
        runner.execute(step)  # warm-up, with the wrappers in place
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                with record_function(LABEL_PREFIX + STEP_RANGE):
                    runner.execute(step)
    totals = {key: 0.0 for key in PHASES}
    step_ms = 0.0
    for event in prof.key_averages():
        if not event.key.startswith(LABEL_PREFIX):
            continue
        ms = event.cpu_time_total / 1e3 / num_steps  # inclusive of what runs inside the range
        key = event.key.removeprefix(LABEL_PREFIX)
        if key == STEP_RANGE:
            step_ms = ms
        else:
            totals[key] += ms
    totals["other"] = step_ms - sum(v for k, v in totals.items() if k != "other")
    return {
        "step_ms": step_ms,
        "phases": {k: {"ms": v, "share": v / step_ms if step_ms else 0.0} for k, v in totals.items()},
    }


def ab_speedup(runners: dict[str, Any], step: Any, pairs: int) -> dict[str, Any]:
    """Paired steps, alternating which variant goes first (so neither always follows the
    other's cache footprint); medians and transformers-over-owned speed-up."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for name in runners:
        runners[name].execute(step)  # warm-up
    names = list(runners)
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            runners[name].execute(step)
            times[name].append(time.perf_counter() - t)
    medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {
        "pairs": pairs,
        "median_ms": medians,
        "speedup": medians["transformers"] / medians["owned"],
    }


def _cell(p: dict[str, float]) -> str:
    return f"{p['ms']:,.1f} ({100 * p['share']:.1f} %)"


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    import torch

    _check_args(args)
    loads = load_note()
    warn_if_busy(loads)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _profile_and_report(args, report, loads)
    finally:  # a process-wide setting: leave it as found (the tests run in one process)
        torch.set_num_threads(threads_before)


def _profile_and_report(args: argparse.Namespace, report: Report, loads: tuple[float, ...]) -> dict[str, Any]:
    import torch

    from pagedserve.common.models import resolve_model_path
    from pagedserve.dataplane.models import LlamaDecoderLayer

    bs = args.block_size
    decode_blocks = args.decode_seqs * -(-args.context // bs)
    num_blocks = decode_blocks + args.prefill_seqs * -(-args.prefill_len // bs)
    model_path = resolve_model_path(args.model)
    runners = {
        name: phase(
            f"load {label}", functools.partial(build_runner, model_path, name == "owned", num_blocks, bs)
        )
        for name, label in VARIANTS.items()
    }
    owned_count = sum(isinstance(layer, LlamaDecoderLayer) for layer in runners["owned"].model.modules())
    vocab = int(runners["owned"].model.config.vocab_size)
    steps = {
        "decode": (
            synthetic_step("d", args.decode_seqs, args.context, 1, 0, bs, vocab, seed=0),
            f"decode {args.decode_seqs} x {args.context}",
            args.decode_steps,
            args.decode_pairs,
        ),
        "prefill": (
            synthetic_step(
                "p", args.prefill_seqs, args.prefill_len, args.prefill_len, decode_blocks, bs, vocab, 1
            ),
            f"prefill {args.prefill_seqs} x {args.prefill_len}",
            args.prefill_steps,
            args.prefill_pairs,
        ),
    }
    profiles: dict[str, dict[str, Any]] = {}
    ab: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for cls, (step, label, num_steps, pairs) in steps.items():
            profiles[cls] = {
                name: phase(
                    f"profile {label}, {vl}", functools.partial(profile_steps, runners[name], step, num_steps)
                )
                for name, vl in VARIANTS.items()
            }
            ab[cls] = phase(f"A/B {label}", functools.partial(ab_speedup, runners, step, pairs))
            ab[cls]["label"] = label

    columns = [(cls, name) for cls in steps for name in VARIANTS]
    rows = [[PHASES[k], *(_cell(profiles[c][n]["phases"][k]) for c, n in columns)] for k in PHASES]
    rows.append(["**step**", *(f"**{profiles[c][n]['step_ms']:,.1f}**" for c, n in columns)])
    report.table(
        "Where the time goes: ms per step (share of the step)",
        ["op class", *(f"{steps[c][1]}, {VARIANTS[n]}" for c, n in columns)],
        rows,
        notes=[
            f"{args.model}, fp32, {args.threads} torch threads; {owned_count} owned decoder layers; "
            f"load average {loads}",
            "other = the step's wall time minus every range above it",
        ],
    )
    report.table(
        "Interleaved A/B (paired steps, alternating order, medians)",
        ["step", "pairs", "transformers layers ms", "owned layers ms", "speed-up"],
        [
            [
                a["label"],
                str(a["pairs"]),
                f"{a['median_ms']['transformers']:,.1f}",
                f"{a['median_ms']['owned']:,.1f}",
                f"{a['speedup']:.3f}x",
            ]
            for a in ab.values()
        ],
    )
    return {
        "model": args.model,
        "threads": args.threads,
        "block_size": bs,
        "owned_layers": owned_count,
        "steps": {
            cls: {"label": label, "profiled_steps": n, "rows": sum(s.num_new_tokens for s in step.scheduled)}
            for cls, (step, label, n, _) in steps.items()
        },
        "profile": profiles,
        "ab": ab,
    }


def main(argv: list[str] | None = None) -> int:
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["step-profile", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
