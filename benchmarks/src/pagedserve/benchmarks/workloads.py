"""Deterministic benchmark workloads, built offline (no downloads, no datasets).

Every builder is a pure function of its arguments and the files shipped in `benchmarks/src/pagedserve/benchmarks/data/`:
the same call returns the same prompts on every machine, so runs are comparable over time.

Workloads
---------
`chat_prompts(tokenizer, n=64, min_tokens=20, max_tokens=300, seed=0)`
    `n` single-turn chat prompts, as token-id lists ready for `LLM.generate`. Each is the
    model's chat template (`apply_chat_template(..., add_generation_prompt=True)`) around
    a short system message and one user message: an English question from a bank of 40
    topics (history, cooking, engineering, nature, science, ...), preceded, when the target
    length leaves room, by background prose taken word by word from
    `benchmarks/src/pagedserve/benchmarks/data/passages.txt` (about 3,000 words of plain English in 24 paragraphs,
    each prompt starting at its own paragraph). Target lengths are spread evenly over
    [min_tokens, max_tokens] and shuffled (seeded); each prompt hits its target within a
    few tokens (the filler is trimmed at word boundaries). With the defaults and the
    SmolLM2 tokenizer the 64 prompts hold about 10,200 tokens in all. Very short targets
    use a shorter system message and, if needed, a shortened question, because the
    template alone costs ~15 tokens. A tokenizer without a chat template gets the same
    text as plain prompts.

`output_lengths(n=64, lo=16, hi=256, seed=0)`
    One output length per request, spread evenly over [lo, hi] and shuffled with a seed
    independent of the prompt order (so long prompts do not get long outputs). With the
    defaults the total is 64 × 136 = 8,704 tokens. Meant for `SamplingParams(max_tokens=L,
    temperature=0.0, ignore_eos=True)`: every request then produces exactly L tokens.

`long_context_prompts(tokenizer, n=16, min_tokens=2048, max_tokens=3840, seed=0)`
    Like `chat_prompts`, for long-context serving: 16 prompts of 2,048-3,840 tokens, the
    background reading followed by one of 8 questions about the whole text (summaries,
    quizzes, comparisons). The passages file holds ~4,000 tokens, so the longest prompts
    repeat a few paragraphs; 3,840 leaves room for 256 output tokens within a
    `max_model_len` of 4096.

`describe(prompts, outputs)`
    A one-line summary (counts, totals, min/mean/max) for logs.

`customer_service_dialogues` (multi-turn chats for the prefix-caching benchmark) lives in
`pagedserve.benchmarks.dialogues`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
PASSAGES_FILE = DATA_DIR / "passages.txt"

QUESTIONS: tuple[str, ...] = (
    "Why did watermills matter so much to farming villages in the past?",
    "How do I bake a loaf of bread with a crisp crust at home?",
    "Explain how a suspension bridge carries the weight of its traffic.",
    "Why do leaves change color in the autumn?",
    "What was daily life like for a lighthouse keeper?",
    "How do I make a simple tomato sauce from fresh tomatoes?",
    "How did the steam engine change where people lived and worked?",
    "What causes coral bleaching, and can reefs recover from it?",
    "What is the best way for an adult to practice a musical instrument?",
    "How were Roman roads built, and why did they last so long?",
    "How should I arrange a small kitchen so that it is easy to cook in?",
    "How do honey bees tell each other where to find flowers?",
    "How is glass made, and how did glassblowing change over time?",
    "What are the main steps in treating drinking water?",
    "What should I carry on a day hike in the mountains?",
    "Why was the printing press so important for the spread of ideas?",
    "Give me a simple recipe for a vegetable soup.",
    "How does an electric motor turn electricity into motion?",
    "Why are wetlands important for rivers and wildlife?",
    "Why do some historical dates appear in two different calendars?",
    "What habits make computer programs easier to maintain?",
    "What is the difference between green tea and black tea?",
    "How does a canal lock raise a boat up a hill?",
    "How can owls hunt in complete darkness?",
    "What is the water cycle? Explain it to a ten year old.",
    "Why is the sky blue during the day and red at sunset?",
    "How do vaccines train the immune system?",
    "What are the pros and cons of working from home?",
    "Summarize the causes of the French Revolution in a few sentences.",
    "How do airplanes stay in the air?",
    "What is compound interest, and why does it matter for saving?",
    "How do I keep basil growing on a windowsill?",
    "Write a short poem about the sea in winter.",
    "What makes a good cup of coffee?",
    "How do earthquakes happen?",
    "Can you suggest a weekly plan for learning a new language?",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "Why do cats purr?",
    "What are three tips for writing a clear email?",
)

# For targets too short for a bank question (the template alone costs ~15 tokens).
SHORT_QUESTIONS: tuple[str, ...] = (
    "Why do cats purr?",
    "What is rain?",
    "Define gravity.",
    "Name a planet.",
    "Hello!",
)

# Longest first: the builder uses the longest that leaves room for the question.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant. Answer clearly and accurately.",
    "You are a helpful assistant.",
    "Be brief.",
)

# Short chat questions with short answers, for greedy comparisons between engines.
SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Give me a synonym for happy.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Explain gravity in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a cat.",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "Why do leaves change color in autumn?",
    "What is a prime number?",
)
CONTEXT_INTRO = "Here is some background reading:\n\n"
CONTEXT_OUTRO = "\n\nQuestion: "


@cache
def _paragraphs() -> tuple[str, ...]:
    text = PASSAGES_FILE.read_text(encoding="utf-8")
    paras = tuple(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())
    if not paras:
        raise RuntimeError(f"{PASSAGES_FILE} holds no paragraphs")
    return paras


def _filler_pieces(start: int, min_words: int) -> list[str]:
    """Words (each with its trailing separator) from paragraph `start` on, wrapping around."""
    paras = _paragraphs()
    pieces: list[str] = []
    i = start
    while len(pieces) < min_words:
        words = paras[i % len(paras)].split(" ")
        pieces.extend(w + " " for w in words[:-1])
        pieces.append(words[-1] + "\n\n")
        i += 1
    return pieces


def _spread(n: int, lo: int, hi: int) -> list[int]:
    """`n` integers spread evenly over [lo, hi] (both ends included when n > 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if lo > hi:
        raise ValueError(f"lo ({lo}) must not exceed hi ({hi})")
    if n == 1:
        return [(lo + hi) // 2]
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def _encode_chat(tokenizer: Any, system: str, user: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    ids: list[int] = tokenizer.encode(f"{system}\n\n{user}\n\n", add_special_tokens=True)
    return ids


def _fill(tokenizer: Any, system: str, question: str, pieces: list[str], target: int) -> list[int] | None:
    """The longest `background + question` prompt within `target` tokens (None: not even 1 word fits).

    Tries the framed form ("Here is some background reading: ... Question: ...") first, then the
    bare form ("... \n\nquestion"), whose frame is a few tokens cheaper.
    """
    for intro, outro in ((CONTEXT_INTRO, CONTEXT_OUTRO), ("", "\n\n")):

        def with_words(k: int, intro: str = intro, outro: str = outro) -> list[int]:
            context = "".join(pieces[:k]).rstrip()
            return _encode_chat(tokenizer, system, f"{intro}{context}{outro}{question}")

        if len(with_words(1)) > target:
            continue
        lo, hi = 1, len(pieces)  # invariant: with_words(lo) fits; with_words(hi + 1) does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(with_words(mid)) <= target:
                lo = mid
            else:
                hi = mid - 1
        return with_words(lo)
    return None


def _build_one(tokenizer: Any, target: int, question: str, start_para: int) -> list[int]:
    """The prompt closest to `target` tokens from below (or the shortest possible one)."""
    # Bare question, longest system message that fits; for very short targets also the short
    # questions, and as a last resort the first words of a short question.
    candidates: list[list[int]] = []
    for system in SYSTEM_PROMPTS:
        ids = _encode_chat(tokenizer, system, question)
        if len(ids) <= target:
            candidates.append(ids)
            if len(ids) < target - 2:
                pieces = _filler_pieces(start_para, min_words=target + 16)  # a token holds < 1 word
                filled = _fill(tokenizer, system, question, pieces, target)
                if filled is not None:
                    candidates.append(filled)
            break

    def best_fit() -> list[int] | None:
        fitting = [c for c in candidates if len(c) <= target]
        return max(fitting, key=len) if fitting else None  # first of the longest: deterministic

    for truncate in (False, True):
        best = best_fit()
        if best is not None and len(best) >= target - 2:
            return best
        for system in SYSTEM_PROMPTS:
            for short in SHORT_QUESTIONS:
                words = short.split()
                for k in range(len(words) - 1, 0, -1) if truncate else [len(words)]:
                    candidates.append(_encode_chat(tokenizer, system, " ".join(words[:k])))
    return best_fit() or min(candidates, key=len)


def chat_prompts(
    tokenizer: Any,
    n: int = 64,
    min_tokens: int = 20,
    max_tokens: int = 300,
    seed: int = 0,
    questions: Sequence[str] = QUESTIONS,
) -> list[list[int]]:
    """`n` chat prompts (token ids) with lengths spread over [min_tokens, max_tokens]; see module doc."""
    targets = _spread(n, min_tokens, max_tokens)
    rng = random.Random(seed)
    rng.shuffle(targets)
    paras = _paragraphs()
    prompts: list[list[int]] = []
    for i, target in enumerate(targets):
        question = questions[(i + seed) % len(questions)]
        start = rng.randrange(len(paras))
        prompts.append(_build_one(tokenizer, target, question, start))
    return prompts


# Questions about the background reading itself: a long-context request reads all of it.
LONG_CONTEXT_QUESTIONS: tuple[str, ...] = (
    "Summarize the background reading above in five bullet points.",
    "Which three facts in the text above surprised you most, and why?",
    "List every invention or technique mentioned in the text above.",
    "Write a short quiz of four questions, with answers, about the text above.",
    "What do the passages above have in common? Answer in one paragraph.",
    "Explain the main idea of the text above to a twelve year old.",
    "Which passage above is the most useful for daily life? Justify your choice.",
    "Write a title and a two-sentence abstract for the text above.",
)


def long_context_prompts(
    tokenizer: Any, n: int = 16, min_tokens: int = 2048, max_tokens: int = 3840, seed: int = 0
) -> list[list[int]]:
    """`n` long chat prompts (2k-4k tokens by default): background reading plus a question about it.

    Built like `chat_prompts` (the filler wraps around `passages.txt`, ~4,000 SmolLM2 tokens, so
    the longest prompts repeat a few paragraphs) with `LONG_CONTEXT_QUESTIONS`, which ask about
    the whole text.
    """
    return chat_prompts(tokenizer, n, min_tokens, max_tokens, seed, LONG_CONTEXT_QUESTIONS)


def output_lengths(n: int = 64, lo: int = 16, hi: int = 256, seed: int = 0) -> list[int]:
    """One output length per request, spread evenly over [lo, hi], shuffled (seeded)."""
    if lo < 1:
        raise ValueError(f"lo must be >= 1, got {lo}")
    lengths = _spread(n, lo, hi)
    random.Random(1_000_003 * seed + 7).shuffle(lengths)
    return lengths


def describe(prompts: Sequence[Sequence[int]], outputs: Sequence[int]) -> str:
    p = [len(x) for x in prompts]
    return (
        f"{len(p)} prompts, {sum(p)} prompt tokens (min {min(p)}, mean {sum(p) / len(p):.1f}, max {max(p)}); "
        f"{sum(outputs)} output tokens (min {min(outputs)}, mean {sum(outputs) / len(outputs):.1f}, "
        f"max {max(outputs)})"
    )
