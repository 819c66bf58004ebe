"""Deterministic benchmark workloads, built offline (no downloads, no datasets).

Every builder is a pure function of its arguments and the files shipped in `benchmarks/data/`:
the same call returns the same prompts on every machine, so runs are comparable over time.

Workloads
---------
`chat_prompts(tokenizer, n=64, min_tokens=20, max_tokens=300, seed=0)`
    `n` single-turn chat prompts, as token-id lists ready for `LLM.generate`. Each is the
    model's chat template (`apply_chat_template(..., add_generation_prompt=True)`) around
    a short system message and one user message: an English question from a bank of 40
    topics (history, cooking, engineering, nature, science, ...), preceded, when the target
    length leaves room, by background prose taken word by word from
    `benchmarks/data/passages.txt` (about 3,000 words of plain English in 24 paragraphs,
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

`customer_service_dialogues(n_conversations=32, seed=0)`
    Multi-turn chats for prefix-caching benchmarks (`pagedserve.benchmarks.prefix_caching`): a list
    of `Dialogue`s, text only (the replies come from the model at run time). Every
    conversation shares ONE system prompt, `benchmarks/data/customer_service_system.txt`
    (an online shop's assistant: tone rules, an 8-item product catalogue, shipping, refund
    and account policies; 615 SmolLM2 tokens, ~620 with its chat-template frame). Each
    conversation has 3, 4 or 5 user turns (counts balanced: cycled then shuffled) on one of
    8 topics (order status, refund, shipping delay, damaged/defective item, account access,
    product question, price adjustment, exchange; also cycled then shuffled): an opening
    message, 1-3 follow-ups drawn without replacement from the topic's bank and, for 5-turn
    conversations, a closing message. Customer names, HP- order numbers, products and
    day counts are filled in from seeded choices, so conversations differ from their first
    user message on: only the system prompt (and each conversation's own history) is shared.
    User messages are ~7-40 tokens (SmolLM2). `Dialogue.messages(replies)` builds the message list of
    the next turn: [system, user 1, assistant 1, ..., user k+1] for k = len(replies).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
PASSAGES_FILE = DATA_DIR / "passages.txt"
CUSTOMER_SERVICE_SYSTEM_FILE = DATA_DIR / "customer_service_system.txt"

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


# -- customer-service dialogues (prefix caching) ---------------------------------------------------
@dataclass(frozen=True)
class Dialogue:
    """One customer-service conversation: the shared system prompt and the customer's turns."""

    conversation_id: str
    topic: str
    system: str
    user_turns: tuple[str, ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    def messages(self, replies: Sequence[str]) -> list[dict[str, str]]:
        """Chat messages for turn `len(replies) + 1`: system, then user/assistant pairs, then
        the next user message (for `apply_chat_template(..., add_generation_prompt=True)`)."""
        k = len(replies)
        if k >= len(self.user_turns):
            raise ValueError(f"{self.conversation_id} has {len(self.user_turns)} turns, got {k} replies")
        msgs = [{"role": "system", "content": self.system}]
        for user, reply in zip(self.user_turns[:k], replies, strict=True):
            msgs.append({"role": "user", "content": user})
            msgs.append({"role": "assistant", "content": reply})
        msgs.append({"role": "user", "content": self.user_turns[k]})
        return msgs


CS_NAMES: tuple[str, ...] = (
    "Maria", "James", "Aiko", "Daniel", "Priya", "Tom", "Fatima", "Lucas",
    "Grace", "Omar", "Sofia", "Ben", "Chen", "Hannah", "Diego", "Nora",
)  # fmt: skip

CS_PRODUCTS: tuple[str, ...] = (
    "Trailhead 2 tent",
    "Summit sleeping bag",
    "Ridgeline 45 pack",
    "Ember camp stove",
    "Cedar Grove base layer",
    "Lakeside water bottle",
    "Hearth wool throw",
    "Harbor linen bedding set",
)

# Per topic: (openings, follow-ups). Placeholders: {name} {order} {product} {other} {days} {size}.
CS_TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "order status": (
        (
            "Hi, I'm {name}. Where is my order {order}? I ordered the {product} {days} days ago.",
            "Hello, can you check order {order} for me? The website has said processing for {days} days.",
            "Hi there, {name} here. I ordered a {product} last week and haven't heard anything since.",
        ),
        (
            "The order number is {order}.",
            "Can I still add a {other} to that order before it ships?",
            "Is it possible to switch it to express shipping?",
            "Will I get an email with the tracking number when it ships?",
            "I need it before a camping trip in {days} days. Will it arrive in time?",
        ),
    ),
    "refund": (
        (
            "Hello, my name is {name} and I'd like to return the {product} from order {order}. It's unused.",
            "Hi, I want a refund for the {product}. It arrived {days} days ago and I changed my mind.",
            "Can I get my money back for order {order}? The {product} is not what I expected.",
        ),
        (
            "I'm not a Pine Club member. How much is the return label?",
            "How long until the money is back on my card?",
            "I already opened the box but never used it. Is that still okay?",
            "Can I get store credit instead of a refund?",
            "It was a gift from my sister. Who gets the refund?",
        ),
    ),
    "shipping delay": (
        (
            "My package for order {order} hasn't moved in {days} days. What is going on?",
            "Hi, I'm {name}. The tracking for my {product} has been stuck at the same depot for a week.",
            "Order {order} was supposed to arrive on Monday and it still isn't here. This is frustrating.",
        ),
        (
            "Can you open a trace with the carrier?",
            "I'd rather have a replacement than a refund. How fast can you send one?",
            "Will I be charged shipping again for the replacement?",
            "What happens if the original package shows up after all?",
            "Can you send the replacement by express at no cost, since this was your delay?",
        ),
    ),
    "damaged item": (
        (
            "Hello, the {product} I received in order {order} is damaged. The box was crushed.",
            "Hi, I'm {name}. My {product} stopped working after {days} days. I think it is defective.",
            "Hi, {name} here. The zipper on my {product} broke on the first trip. Is that covered?",
        ),
        (
            "I can send a photo. Where should I upload it?",
            "Do I need to pay to ship it back to you?",
            "Would you repair it or send a new one?",
            "How long does a warranty replacement usually take?",
            "I bought it {days} months ago. Is it still under warranty?",
        ),
    ),
    "account access": (
        (
            "Hi, it's {name}. I can't log in to my account. It says my password is wrong but I'm sure it's right.",
            "Hi, I'm {name}. My account got locked after I tried to sign in a few times.",
            "This is {name}. I never received the password reset email. Can you help me get into my account?",
        ),
        (
            "I checked the spam folder and there is nothing there either.",
            "How long do I have to wait before I can try again?",
            "Can you change the email address on my account to my new one?",
            "I think I have two accounts. Can you merge them so I keep my points?",
            "Will I lose my Pine Club points if I make a new account?",
        ),
    ),
    "product question": (
        (
            "Hi! Is the {product} a good choice for a beginner going on a {days}-day hike?",
            "Hello, I'm {name}. Should I buy the {product} or the {other} first for my camping trips?",
            "Does the {product} come in size {size}, and how much is it?",
        ),
        (
            "Would it work together with the {other}?",
            "Is it in stock right now?",
            "If I buy both, do I get free shipping?",
            "What if it doesn't fit? Can I exchange it?",
            "Do you ship that to Canada, and how long does it take?",
        ),
    ),
    "price adjustment": (
        (
            "I bought the {product} {days} days ago and now it's on sale for less. Can I get the difference back?",
            "Hi, I'm {name}. The price of the {product} in order {order} dropped after I bought it.",
            "Hello, it's {name}. Is there a price match if the {product} I just ordered goes on sale?",
        ),
        (
            "The order number is {order}.",
            "How will I receive the difference?",
            "The {other} I bought at the same time dropped too. Can you adjust that one as well?",
            "Does it work if I bought it in your store and not online?",
            "Can I get points instead of money back?",
        ),
    ),
    "exchange": (
        (
            "Hi, I'm {name}. The {product} I ordered is too small. Can I exchange it for size {size}?",
            "I'd like to swap the {product} from order {order} for a different color.",
            "Can I exchange my {product} for the {other} and pay the difference?",
        ),
        (
            "Do I have to return the first one before you send the new one?",
            "Is there a fee for the exchange?",
            "How long will the exchange take in total?",
            "If the new size is out of stock, can I get a refund instead?",
            "Can you send me a return label by email?",
        ),
    ),
}

CS_CLOSINGS: tuple[str, ...] = (
    "Great, thank you for your help!",
    "Okay, that answers my question. Thanks, have a nice day.",
    "Perfect. That's everything for now.",
    "Thanks. Can you send me a summary of this chat by email?",
    "Alright, I'll wait for the email then. Bye!",
    "Thank you, you've been very helpful.",
)


@cache
def customer_service_system_prompt() -> str:
    """The shared ~600-token system prompt of `customer_service_dialogues`."""
    text = CUSTOMER_SERVICE_SYSTEM_FILE.read_text(encoding="utf-8").strip()
    if not text:
        raise RuntimeError(f"{CUSTOMER_SERVICE_SYSTEM_FILE} is empty")
    return text


def customer_service_dialogues(n_conversations: int = 32, seed: int = 0) -> list[Dialogue]:
    """`n_conversations` deterministic customer-service chats sharing one system prompt; see module doc."""
    if n_conversations < 1:
        raise ValueError(f"n_conversations must be >= 1, got {n_conversations}")
    rng = random.Random(2_000_029 * seed + 11)
    system = customer_service_system_prompt()
    topics = list(CS_TOPICS)
    topic_of = [topics[i % len(topics)] for i in range(n_conversations)]
    turns_of = [3 + i % 3 for i in range(n_conversations)]
    rng.shuffle(topic_of)
    rng.shuffle(turns_of)
    dialogues: list[Dialogue] = []
    for i, (topic, n_turns) in enumerate(zip(topic_of, turns_of, strict=True)):
        product, other = rng.sample(CS_PRODUCTS, 2)
        fields = {
            "name": rng.choice(CS_NAMES),
            "order": f"HP-{rng.randrange(10**8):08d}",
            "product": product,
            "other": other,
            "days": str(rng.randint(2, 12)),
            "size": rng.choice(("S", "M", "L")),
        }
        openings, follow_ups = CS_TOPICS[topic]
        n_follow = n_turns - 1 if n_turns < 5 else n_turns - 2
        texts = [rng.choice(openings), *rng.sample(follow_ups, n_follow)]
        if n_turns == 5:
            texts.append(rng.choice(CS_CLOSINGS))
        turns = tuple(t.format(**fields) for t in texts)
        dialogues.append(Dialogue(f"conv-{i:03d}", topic, system, turns))
    return dialogues
