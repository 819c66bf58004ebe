"""Reasoning parsers (`--reasoning-parser`): a reasoning model's `<think>…</think>` section
split out of its answer, as `reasoning_content` (and vLLM's newer `reasoning`) beside
`content` in chat messages and stream deltas.

- "qwen3" (Qwen3, QwQ): the section is reasoning only when the output begins with `<think>`
  (after whitespace); it ends at `</think>`. An output that does not begin with it is all
  content.
- "deepseek_r1" (DeepSeek-R1 and its distills, whose template opens `<think>` in the
  prompt): the output is reasoning from its start (a `<think>` the model writes anyway is
  dropped) until `</think>`; an output that never closes it is all reasoning.

The tags themselves are in neither part. What follows `</think>` is the content, which the
tool-call parser then reads (tool calls come after the reasoning). A splitter gives the same
split whether the text comes whole or in pieces: text that may be the start of a tag is held
back until the next piece (or the end) decides it.
"""

from __future__ import annotations

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
"""`--reasoning-parser` values ("none": answers are content only)."""
START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back until known)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One answer's text split into (reasoning, content) pieces as it is generated."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS[1:]:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS[1:])}")
        self.parser = parser
        # "start": the opening not yet decided; "reasoning"; "content".
        self.state = "start"
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text`, newly generated, makes certain."""
        self.pending += text
        reasoning, content = "", ""
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(START):
                self.pending, self.state = stripped[len(START) :], "reasoning"
            elif START.startswith(stripped):
                return "", ""  # (whitespace, or part of the tag: not decided yet)
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            end = self.pending.find(END)
            if end < 0:
                keep = _held(self.pending, END)
                reasoning, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return reasoning, ""
            reasoning, self.pending, self.state = (
                self.pending[:end],
                self.pending[end + len(END) :],
                "content",
            )
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text has ended."""
        rest, self.pending = self.pending, ""
        if self.state == "start":  # (only whitespace or a part of "<think>": the answer's text)
            return ("", rest) if self.parser == "qwen3" else (rest, "")
        return (rest, "") if self.state == "reasoning" else ("", rest)


class ChoiceReasoning:
    """The splitters of one response's choices (made on a choice's first text)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._splitters: dict[int, ReasoningSplitter] = {}

    def _splitter(self, index: int) -> ReasoningSplitter:
        splitter = self._splitters.get(index)
        if splitter is None:
            splitter = self._splitters[index] = ReasoningSplitter(self.parser)
        return splitter

    def feed(self, index: int, text: str) -> tuple[str, str]:
        return self._splitter(index).feed(text)

    def finish(self, index: int) -> tuple[str, str]:
        return self._splitter(index).finish()

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content)."""
        splitter = ReasoningSplitter(self.parser)
        r1, c1 = splitter.feed(text)
        r2, c2 = splitter.finish()
        return r1 + r2, c1 + c2


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A message's or delta's reasoning, under both names clients read."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
