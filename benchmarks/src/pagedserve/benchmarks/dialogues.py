"""Customer-service dialogues, the prefix-caching benchmark's workload, built offline.

`customer_service_dialogues(n_conversations=32, seed=0)`
    Multi-turn chats for prefix-caching benchmarks (`pagedserve.benchmarks.prefix_caching`): a list
    of `Dialogue`s, text only (the replies come from the model at run time). Every
    conversation shares ONE system prompt, `benchmarks/src/pagedserve/benchmarks/data/customer_service_system.txt`
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
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from pagedserve.benchmarks.workloads import DATA_DIR

CUSTOMER_SERVICE_SYSTEM_FILE = DATA_DIR / "customer_service_system.txt"


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
