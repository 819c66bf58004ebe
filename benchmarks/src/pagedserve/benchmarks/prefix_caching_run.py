"""`bench prefix-caching`, one run: the dialogues turn by turn through one engine, each turn's
prompt, reused blocks, time to first token and reply."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.benchmarks.common import engine_from_args
from pagedserve.benchmarks.dialogues import Dialogue
from pagedserve.benchmarks.workloads import chat_prompts


# -- helpers -----------------------------------------------------------------------------------
def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template over `messages`, ending with the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant: "
    ids: list[int] = tokenizer.encode(text, add_special_tokens=True)
    return ids


def system_prompt_tokens(tokenizer: Any, system: str) -> int:
    """Tokens of the system message alone, chat-template frame included."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], tokenize=True, return_dict=True
        )
        return len(out["input_ids"])
    return len(tokenizer.encode(f"system: {system}\n\n", add_special_tokens=True))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- one run -----------------------------------------------------------------------------------
@dataclass
class TurnRecord:
    conversation: str
    turn: int  # 1-based
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int  # block-aligned upper bound on cacheable prefix (filled after the run)
    output_token_ids: list[int]
    reply_tokens: int  # output tokens before the first end-of-turn token (fed back as history)
    arrival_s: float  # since the start of the measured run
    ttft_s: float
    latency_s: float
    num_preemptions: int
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class DialogueRun:
    label: str  # "on" | "off"
    enable_prefix_caching: bool
    load_seconds: float
    warmup_seconds: float
    wall_seconds: float
    client_seconds: float  # templating + tokenizing + decoding replies inside the measured loop
    steps: int
    step_log: list[tuple[float, float, int, int]]  # (start since run start, seconds, batched tokens, sampled)
    batched_tokens: int
    preempted: int  # sum of StepResult.num_preempted
    prefix_stats: dict[str, int]  # counter deltas over the measured run
    turns: list[TurnRecord]
    num_blocks: int


def _reply_end(output: Sequence[int], stop_ids: set[int]) -> int:
    return next((i for i, t in enumerate(output) if t in stop_ids), len(output))


def run_dialogues(
    args: argparse.Namespace, model: str, dialogues: list[Dialogue], caching: bool
) -> DialogueRun:
    from pagedserve.dataplane import SamplingParams

    t = time.perf_counter()
    llm = engine_from_args(args, model, enable_prefix_caching=caching)
    load_s = time.perf_counter() - t
    engine = llm.engine
    tok: Any = engine.tokenizer
    if tok is None:
        raise RuntimeError(f"{model} has no tokenizer: the dialogue workload needs one")

    # Warm-up on unrelated prompts (another system prompt), then forget what they cached.
    t = time.perf_counter()
    warm_prompts = chat_prompts(tok, 4, 64, 700, seed=1)
    warm = llm.generate(
        warm_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    if any(len(o.token_ids) != 8 for o in warm):
        raise RuntimeError(f"warm-up produced lengths {[len(o.token_ids) for o in warm]}, expected 8")
    llm.reset_prefix_cache()
    warm_s = time.perf_counter() - t
    stats0 = dataclasses.replace(engine.kv_cache.prefix_cache_stats)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    stop_ids = set(getattr(engine, "eos_token_ids", ()) or ())
    if getattr(tok, "eos_token_id", None) is not None:
        stop_ids.add(int(tok.eos_token_id))

    replies: list[list[str]] = [[] for _ in dialogues]
    inflight: dict[str, tuple[int, list[int]]] = {}
    records: list[TurnRecord] = []
    client_s = 0.0
    steps = batched = preempted = idle = 0
    step_log: list[tuple[float, float, int, int]] = []
    next_conv = 0

    t0 = time.monotonic()

    def submit(ci: int) -> None:
        nonlocal client_s
        c = time.perf_counter()
        d = dialogues[ci]
        ids = encode_chat(tok, d.messages(replies[ci]))
        client_s += time.perf_counter() - c
        rid = f"{d.conversation_id}-t{len(replies[ci]) + 1}"
        engine.add_request(ids, params, request_id=rid)
        inflight[rid] = (ci, ids)

    while next_conv < min(args.concurrency, len(dialogues)):
        submit(next_conv)
        next_conv += 1
    while engine.has_unfinished_requests():
        s0 = time.monotonic()
        result = engine.step()
        step_log.append((s0 - t0, time.monotonic() - s0, result.num_batched_tokens, len(result.new_tokens)))
        steps += 1
        batched += result.num_batched_tokens
        preempted += result.num_preempted
        idle = idle + 1 if result.num_batched_tokens == 0 and not result.finished else 0
        if idle > 100:
            raise RuntimeError("engine.step() made no progress for 100 steps with requests pending")
        for r in result.finished:
            ci, ids = inflight.pop(r.request_id)
            d = dialogues[ci]
            out = list(r.output_token_ids)
            if len(out) != args.max_tokens:
                raise RuntimeError(f"{r.request_id}: {len(out)} output tokens, expected {args.max_tokens}")
            if r.first_token_time is None or r.finish_time is None:
                raise RuntimeError(f"{r.request_id}: finished without first-token/finish times")
            c = time.perf_counter()
            end = _reply_end(out, stop_ids)
            reply = str(tok.decode(out[:end], skip_special_tokens=True)).strip()
            client_s += time.perf_counter() - c
            records.append(
                TurnRecord(
                    conversation=d.conversation_id,
                    turn=len(replies[ci]) + 1,
                    request_id=r.request_id,
                    prompt_tokens=r.num_prompt_tokens,
                    cached_tokens=r.num_cached_tokens,
                    reusable_tokens=0,
                    output_token_ids=out,
                    reply_tokens=end,
                    arrival_s=r.arrival_time - t0,
                    ttft_s=r.first_token_time - r.arrival_time,
                    latency_s=r.finish_time - r.arrival_time,
                    num_preemptions=int(getattr(r, "num_preemptions", 0)),
                    prompt_token_ids=ids,
                )
            )
            engine.release(r.request_id)
            replies[ci].append(reply)
            if len(replies[ci]) < d.num_turns:
                submit(ci)
            elif next_conv < len(dialogues):
                submit(next_conv)
                next_conv += 1
    wall_s = time.monotonic() - t0
    if inflight or next_conv < len(dialogues):
        raise RuntimeError(
            f"run ended with {len(inflight)} turns in flight, {next_conv} conversations started"
        )

    s1 = engine.kv_cache.prefix_cache_stats
    deltas = {f.name: getattr(s1, f.name) - getattr(stats0, f.name) for f in dataclasses.fields(s1)}
    num_blocks = int(engine.budget.num_blocks)
    _fill_reusable(records, args.block_size)
    return DialogueRun(
        label="on" if caching else "off",
        enable_prefix_caching=caching,
        load_seconds=load_s,
        warmup_seconds=warm_s,
        wall_seconds=wall_s,
        client_seconds=client_s,
        steps=steps,
        step_log=step_log,
        batched_tokens=batched,
        preempted=preempted,
        prefix_stats=deltas,
        turns=records,
        num_blocks=num_blocks,
    )


def _fill_reusable(records: list[TurnRecord], block_size: int) -> None:
    """Upper bound on cacheable tokens per turn: the longest prefix shared with the same
    conversation's previous turn (prompt + output) or with the first prompt submitted (the
    system prompt), in whole blocks, leaving at least one prompt token to compute."""
    if not records:
        return
    first = min(records, key=lambda r: r.arrival_s).prompt_token_ids
    prev: dict[tuple[str, int], list[int]] = {
        (r.conversation, r.turn): r.prompt_token_ids + r.output_token_ids for r in records
    }
    for r in records:
        ids = r.prompt_token_ids
        best = 0 if ids is first else common_prefix(ids, first)
        before = prev.get((r.conversation, r.turn - 1))
        if before is not None:
            best = max(best, common_prefix(ids, before))
        best = min(best, len(ids) - 1)
        r.reusable_tokens = best // block_size * block_size
