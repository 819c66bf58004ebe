"""vLLM's `bad_words`: words a completion must never contain, tokenized here (the control plane
owns the tokenizer) into the token sequences the data plane's sampler masks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.controlplane.errors import invalid_argument

MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


def bad_words_token_ids(
    encode: Callable[[str], list[int]], words: Sequence[object], field_name: str
) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids, as vLLM tokenizes them: the word (leading spaces stripped), and
    with one leading space too when that makes a different first token but as many tokens (the
    word inside the text, not at its start). Raises INVALID_ARGUMENT naming `field_name`."""
    if len(words) > MAX_BAD_WORDS:
        raise invalid_argument(f"{field_name}: at most {MAX_BAD_WORDS} words, got {len(words)}", field_name)
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        name = f"{field_name}[{i}]"
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            reason = f"must be a non-blank string of at most {MAX_BAD_WORD_CHARS} characters"
            raise invalid_argument(f"{name}: {reason}", name)
        try:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
        except ValueError as exc:  # a model without a tokenizer
            raise invalid_argument(f"{name}: {exc}", name) from None
        if not plain:
            raise invalid_argument(f"{name}: tokenizes to no tokens", name)
        out.append(tuple(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)
