"""vLLM's bad_words tokenized as vLLM does: the word, and with a leading space when that makes
another first token of the same length; bad values refused naming the word."""

from __future__ import annotations

import pytest

from pagedserve.controlplane.bad_words import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, bad_words_token_ids
from pagedserve.controlplane.errors import ServiceError

VOCAB = {"cat": [1], " cat": [2], "dog": [3, 4], " dog": [5, 4], "ox": [6], " ox": [7, 6], "a b": [8, 9, 10]}


def encode(text: str) -> list[int]:
    return VOCAB.get(text, [99])


def test_each_word_with_and_without_a_leading_space() -> None:
    assert bad_words_token_ids(encode, ["cat", "  dog", "ox"], "bad_words") == (
        (1,),
        (2,),
        (3, 4),
        (5, 4),
        (6,),
    )


@pytest.mark.parametrize(
    ("words", "param"),
    [
        (["ok"] * (MAX_BAD_WORDS + 1), "bad_words"),
        (["cat", ""], "bad_words[1]"),
        (["  "], "bad_words[0]"),
        (["x" * (MAX_BAD_WORD_CHARS + 1)], "bad_words[0]"),
        ([3], "bad_words[0]"),
    ],
)
def test_bad_values_name_the_word(words: list[object], param: str) -> None:
    with pytest.raises(ServiceError) as err:
        bad_words_token_ids(encode, words, "bad_words")
    assert err.value.param == param
