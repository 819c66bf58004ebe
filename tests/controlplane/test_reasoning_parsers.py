"""Reasoning parsers: `<think>…</think>` split out of an answer, the same split however the
text is cut into streamed pieces (tags split across pieces included)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.controlplane.reasoning import ChoiceReasoning, ReasoningSplitter


def streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser)
    reasoning, content = "", ""
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(
    ("parser", "text", "split"),
    [
        ("qwen3", "<think>I add.</think>\n\n4", ("I add.", "\n\n4")),
        ("qwen3", "  <think>a</think>b", ("a", "b")),
        ("qwen3", "no tags, 4", ("", "no tags, 4")),
        ("qwen3", "4 <think>late</think>", ("", "4 <think>late</think>")),
        ("qwen3", "<think>cut short", ("cut short", "")),
        ("qwen3", "<thi", ("", "<thi")),
        ("qwen3", "", ("", "")),
        ("deepseek_r1", "I add.</think>4", ("I add.", "4")),
        ("deepseek_r1", "<think>I add.</think>4", ("I add.", "4")),
        ("deepseek_r1", "never closed", ("never closed", "")),
        ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_splits(parser: str, text: str, split: tuple[str, str]) -> None:
    assert ChoiceReasoning(parser).split(text) == split
    assert streamed(parser, list(text)) == split  # one character at a time


TEXTS = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think", ">", " ", "\n", "a", "bc", "</thin"]),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(["qwen3", "deepseek_r1"]),
    text=TEXTS,
    cuts=st.lists(st.integers(0, 80), max_size=6),
)
def test_any_cut_into_pieces_splits_as_the_whole_text(parser: str, text: str, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c <= len(text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    reasoning, content = streamed(parser, pieces)
    assert (reasoning, content) == ChoiceReasoning(parser).split(text)


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningSplitter("gpt")
