"""Incremental detokenization: never splits a UTF-8 character, stop strings cut exactly."""

from __future__ import annotations

import pytest

from pagedserve.controlplane.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte, like a byte-level BPE's worst case (a character over several tokens)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def feed(det: IncrementalDetokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    return [det.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo → 世界 🙂!"
    det = IncrementalDetokenizer(ByteTokenizer(), ids("prompt "))
    pieces = feed(det, ids(text))
    assert "".join(pieces) + det.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # The four bytes of the emoji produce nothing until the last one arrives.
    emoji_at = len(ids("héllo → 世界 "))
    assert pieces[emoji_at : emoji_at + 3] == ["", "", ""]
    assert pieces[emoji_at + 3] == "🙂"


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_across_tokens_is_cut_and_reported(step: int) -> None:
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("END", "\n\n"))
    sent = "".join(feed(det, ids("answer is 42.\n\nmore text END"), step))
    assert det.stopped and det.stop_string == "\n\n"
    assert sent + det.flush() == "answer is 42."
    assert det.add(ids("ignored")) == ""


def test_text_is_held_back_only_as_long_as_a_stop_string_could_still_match() -> None:
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("STOP",))
    assert "".join(feed(det, ids("a STO"))) == "a "  # "STO" might still become "STOP"
    # The hold-back window is len("STOP") - 1 characters: one more character releases one.
    assert det.add(ids("x")) == "S"
    assert det.flush() == "TOx"
    assert not det.stopped and det.text == "a STOx"


def test_flush_returns_exactly_the_held_back_text() -> None:
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("STOP",))
    sent = "".join(feed(det, ids("a STO")))
    assert sent + det.flush() == "a STO"
    assert not det.stopped


def test_earliest_stop_string_wins() -> None:
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("world", "lo w"))
    sent = "".join(feed(det, ids("hello world"), step=11))
    assert (sent, det.stop_string) == ("hel", "lo w")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(ByteTokenizer(), [1], stop=("",))


@pytest.mark.parametrize("step", [1, 3, 40])
def test_include_stop_keeps_the_matched_stop_string(step: int) -> None:
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("END", "\n\n"), include_stop=True)
    sent = "".join(feed(det, ids("answer is 42.\n\nmore text END"), step))
    assert det.stop_string == "\n\n"
    assert sent + det.flush() == "answer is 42.\n\n"


@pytest.mark.parametrize("step", [1, 2, 4, 40])
def test_no_stop_string_is_matched_before_min_tokens(step: int) -> None:
    # "|" is the 3rd token: a stop string ending there is not matched; one ending in the 5th
    # token (min_tokens = 4 reached) is, even if it starts before.
    det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("|", "cd"), min_tokens=4)
    sent = "".join(feed(det, ids("ab|cde|f"), step))
    assert det.stop_string == "cd"
    assert sent + det.flush() == "ab|"
    for min_tokens, text in ((4, "ab|cde"), (3, "ab")):  # as vLLM: the min_tokens-th token may match
        det = IncrementalDetokenizer(ByteTokenizer(), ids("q"), stop=("|",), min_tokens=min_tokens)
        sent = "".join(feed(det, ids("ab|cde|f"), step))
        assert sent + det.flush() == text
