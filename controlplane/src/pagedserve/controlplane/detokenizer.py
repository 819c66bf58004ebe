"""Incremental detokenization with stop strings.

Token ids arrive a few at a time; the text a client sees must never split a UTF-8 character
(a byte-level BPE token can hold half of one) and must not include a stop string. Decoding
re-reads a small window (`prefix_offset`..end) and emits only what grew past the previous
read, holding back text while it ends in U+FFFD (an incomplete character). The window starts
a few prompt tokens back so tokenizers whose decoders strip a leading space (SentencePiece
"▁") still produce it for the first generated word.

vLLM's extras: with `include_stop` a matched stop string stays in the text; before
`min_tokens` tokens were generated no stop string is matched (one ending inside those tokens
never ends the completion).
"""

from __future__ import annotations

from typing import Protocol

_PROMPT_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop string excluded once one matched)
        self._sent = 0  # characters of `text` already returned
        self.stop_string: str | None = None
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._match_end = 0  # a stop string must end past this many characters of `text`

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that can be sent now (maybe empty)."""
        if self.stopped:
            return ""
        short = self._min_tokens - 1 - self._num_tokens
        if 0 < short < len(token_ids):  # the min_tokens-th token is inside: match from exactly it
            return self.add(token_ids[:short]) + self.add(token_ids[short:])
        self._num_tokens += len(token_ids)
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        if self._num_tokens < self._min_tokens:
            self._match_end = len(self.text)
        elif self._stop:
            self._match_stop()
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """At the end of the completion: whatever was held back for a possible stop string."""
        return self._take(final=True)

    def _match_stop(self) -> None:
        start = max(0, self._sent - self._holdback)
        best: tuple[int, str] | None = None
        for s in self._stop:
            at = self.text.find(s, max(start, self._match_end - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.text = self.text[: best[0] + (len(best[1]) if self._include_stop else 0)]
            self.stop_string = best[1]

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or not self._stop else max(self._sent, len(self.text) - self._holdback)
        out = self.text[self._sent : end]
        self._sent = end
        return out
