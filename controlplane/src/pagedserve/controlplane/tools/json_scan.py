"""An incremental JSON scanner: how far a text that may stop mid-value is valid JSON.

A tool call streams as JSON that is unfinished until the model's last token, so the output
parsers (pagedserve.controlplane.tools.parsers) need more than `json.loads`: where a value ends if it
does, whether the text so far can still become valid JSON, and if not, where the valid part
stops. `scan_value` answers that for one value and `scan_object` also names an object's
top-level members with the raw spans of their values, to find a call's "name" and
"arguments" without re-serializing anything. Both are one-shot uses of `JsonScanner`, which
keeps its place between scans of a growing text, so a parser following a streamed value reads
each character once.

Three outcomes, for the text from `start`:
- complete: `end` is the index just past the value;
- incomplete: the text ends inside the value (`end` is None, `valid_end` is `len(text)`);
  a number or a literal that reaches the end of the text is incomplete, as more digits or
  letters may follow;
- malformed: no continuation can make it valid (`end` is None, `malformed`, `valid_end` is
  the index of the first offending character).

The scan is strict RFC 8259 (no NaN, no raw control characters in strings) and an explicit
state machine, not a recursion, so deep nesting cannot exhaust Python's stack; nesting beyond
`MAX_DEPTH` counts as malformed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

MAX_DEPTH = 128
"""The deepest nesting of objects and arrays accepted; one level more is malformed."""

_WHITESPACE_RUN = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_DIGIT_RUN = re.compile(r"[0-9]*")
_DIGITS = frozenset("0123456789")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # json.loads pairs what it can; the rest are lone
_LITERALS = {"t": "true", "f": "false", "n": "null"}


@dataclass(frozen=True)
class ValueScan:
    """Where one scanned JSON value ends, or how far it is valid."""

    end: int | None  # just past the value; None when incomplete or malformed
    valid_end: int  # the end of the longest valid prefix (`end` when complete)
    malformed: bool

    @property
    def complete(self) -> bool:
        return self.end is not None


@dataclass(frozen=True)
class Member:
    """One top-level member of an object: its key and the raw span of its value."""

    key: str
    start: int  # the value's first character
    end: int | None  # just past the value; None while incomplete (or where it turned malformed)


@dataclass(frozen=True)
class ObjectScan:
    """A scanned object: its members so far (in order, duplicates kept) and where it ends."""

    members: tuple[Member, ...]
    end: int | None
    valid_end: int
    malformed: bool

    def member(self, *keys: str) -> Member | None:
        """The first member whose key is one of `keys`."""
        return next((m for m in self.members if m.key in keys), None)


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i` (or `len(text)`)."""
    match = _WHITESPACE_RUN.match(text, i)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def decode_string(text: str, start: int, end: int) -> str:
    """The value of the complete JSON string `text[start:end]` (as scanned, so it is valid).

    A lone surrogate escape (`"\\ud800"`, valid JSON but no Unicode text) becomes U+FFFD, so
    that the value can always be sent on as UTF-8.
    """
    value = json.loads(text[start:end])
    assert isinstance(value, str)
    if _SURROGATE.search(value) is None:
        return value
    return _SURROGATE.sub("\ufffd", value)


# A piece scanner returns (end, stop): `end` just past the piece or None, and `stop` the valid
# prefix's end: `len(text)` when the text ends inside the piece, else the offending index.
_Piece = tuple[int | None, int]


def _scan_escape(text: str, j: int) -> _Piece:
    """An escape sequence starting at its backslash `text[j]`."""
    n = len(text)
    if j + 1 == n:
        return None, n
    kind = text[j + 1]
    if kind in _SIMPLE_ESCAPES:
        return j + 2, j + 2
    if kind != "u":
        return None, j + 1
    for k in range(j + 2, j + 6):
        if k == n:
            return None, n
        if text[k] not in _HEX_DIGITS:
            return None, k
    return j + 6, j + 6


def _digits_end(text: str, i: int) -> int:
    match = _DIGIT_RUN.match(text, i)
    assert match is not None
    return match.end()


def _scan_number(text: str, i: int) -> _Piece:
    """A number starting at `text[i]` ('-' or a digit); one that reaches the end is incomplete."""
    n = len(text)
    j = i + 1 if text[i] == "-" else i
    if j == n:
        return None, n
    if text[j] == "0":
        j += 1
    elif text[j] in _DIGITS:
        j = _digits_end(text, j)
    else:
        return None, j
    for marks, signs in ((".", ""), ("eE", "+-")):
        if j == n:
            return None, n
        if text[j] not in marks:
            continue
        j += 1
        if j < n and text[j] in signs:
            j += 1
        if j == n:
            return None, n
        if text[j] not in _DIGITS:
            return None, j
        j = _digits_end(text, j)
    if j == n:
        return None, n
    return j, j


def _scan_literal(text: str, i: int, word: str) -> _Piece:
    n = len(text)
    for k, char in enumerate(word):
        if i + k == n:
            return None, n
        if text[i + k] != char:
            return None, i + k
    return i + len(word), i + len(word)


def _scan_scalar(text: str, i: int) -> _Piece:
    """A number or literal at `text[i]` (not whitespace, not a string), or malformed there."""
    char = text[i]
    if char == "-" or char in _DIGITS:
        return _scan_number(text, i)
    word = _LITERALS.get(char)
    if word is not None:
        return _scan_literal(text, i, word)
    return None, i


class _Step(Enum):
    MORE = "more"  # go on scanning
    ENDED = "ended"  # the text ended; the scanner's state is where to go on


# What the scanner expects at its position: a value (no whitespace first), whitespace then a
# value, an object's first key or its "}", an array's first value or its "]", a key, the ":",
# "," or a closing bracket after a value, and the rest of a string (a key or a value).
_VALUE, _VALUE_WS, _FIRST_KEY, _FIRST_VALUE, _KEY, _COLON, _AFTER_VALUE, _STRING = range(8)


class JsonScanner:
    """Scans the JSON value that begins at `start` of a text that only grows.

    Each `scan` goes on from where the previous one stopped (a long string from its last
    character, a number or a literal from its first), so following a value as it streams costs
    the new text only; the text given must extend the one given before. The answers are those
    of scanning each text afresh. An object's top-level members are recorded on the way.
    """

    def __init__(self, start: int, depth: int = 0) -> None:
        self._start = start
        self._depth = depth  # the containers that enclose the value
        self._closers: list[str] = []  # the closing bracket of each open container, innermost last
        self._state = _VALUE
        self._pos = start
        self._token = start  # where the string being read began
        self._string_is_key = False
        self._key = ""  # the last top-level key read
        self._open: tuple[str, int] | None = None  # the top-level member whose value is being read
        self._members: list[Member] = []
        self._result: ValueScan | None = None  # once complete or malformed

    def scan(self, text: str) -> ValueScan:
        """The value as far as `text` goes."""
        if self._result is None:
            self._result = self._run(text)
        return self._result or ValueScan(None, len(text), False)

    def scan_object(self, text: str) -> ObjectScan:
        """The same, for a value that must be an object, with its top-level members."""
        if self._start < len(text) and text[self._start] != "{":
            return ObjectScan((), None, self._start, True)
        scan = self.scan(text)
        return ObjectScan(self._members_so_far(), scan.end, scan.valid_end, scan.malformed)

    def _members_so_far(self) -> tuple[Member, ...]:
        if self._open is None:
            return tuple(self._members)
        return (*self._members, Member(*self._open, None))

    def _run(self, text: str) -> ValueScan | None:
        while True:
            step = self._step(text)
            if step is _Step.ENDED:
                return None
            if step is not _Step.MORE:
                return step

    def _step(self, text: str) -> ValueScan | _Step:
        state = self._state
        if state == _STRING:
            return self._string(text)
        if state == _AFTER_VALUE and not self._closers:
            return ValueScan(self._pos, self._pos, False)
        if state != _VALUE:
            self._pos = skip_whitespace(text, self._pos)
        if self._pos == len(text):
            return _Step.ENDED
        char = text[self._pos]
        if state == _VALUE:
            return self._value(text, char)
        if (state == _FIRST_KEY and char == "}") or (state == _FIRST_VALUE and char == "]"):
            return self._close()
        if state in (_FIRST_KEY, _KEY):
            return self._begin_key(char)
        if state in (_FIRST_VALUE, _VALUE_WS):
            self._state = _VALUE
            return _Step.MORE
        if state == _COLON:
            return self._colon(char)
        return self._after_value(char)

    def _value(self, text: str, char: str) -> ValueScan | _Step:
        pos = self._pos
        if char in "{[" and self._depth + len(self._closers) >= MAX_DEPTH:
            return _malformed(pos)
        if self._in_top_object() and self._open is None:
            self._open = (self._key, pos)
        if char in "{[":
            self._closers.append("}" if char == "{" else "]")
            self._pos = pos + 1
            self._state = _FIRST_KEY if char == "{" else _FIRST_VALUE
            return _Step.MORE
        if char == '"':
            return self._begin_string(is_key=False)
        end, stop = _scan_scalar(text, pos)
        if end is None:
            # At the end of the text a number or literal is read again from its start.
            return _Step.ENDED if stop == len(text) else _malformed(stop)
        self._pos = end
        return self._value_done()

    def _begin_key(self, char: str) -> ValueScan | _Step:
        if char != '"':
            return _malformed(self._pos)
        return self._begin_string(is_key=True)

    def _begin_string(self, is_key: bool) -> _Step:
        self._token = self._pos
        self._pos += 1
        self._string_is_key = is_key
        self._state = _STRING
        return _Step.MORE

    def _string(self, text: str) -> ValueScan | _Step:
        n = len(text)
        j = self._pos
        while True:
            match = _STRING_RUN.match(text, j)
            assert match is not None
            j = match.end()
            if j == n:
                self._pos = n
                return _Step.ENDED
            if text[j] == '"':
                break
            if text[j] != "\\":
                return _malformed(j)  # a raw control character
            end, stop = _scan_escape(text, j)
            if end is None:
                self._pos = j  # an unfinished escape is read again from its backslash
                return _Step.ENDED if stop == n else _malformed(stop)
            j = end
        self._pos = j + 1
        if not self._string_is_key:
            return self._value_done()
        if self._in_top_object():
            self._key = decode_string(text, self._token, self._pos)
        self._state = _COLON
        return _Step.MORE

    def _colon(self, char: str) -> ValueScan | _Step:
        if char != ":":
            return _malformed(self._pos)
        self._pos += 1
        self._state = _VALUE_WS
        return _Step.MORE

    def _after_value(self, char: str) -> ValueScan | _Step:
        if char == self._closers[-1]:
            return self._close()
        if char != ",":
            return _malformed(self._pos)
        self._pos += 1
        self._state = _KEY if self._closers[-1] == "}" else _VALUE_WS
        return _Step.MORE

    def _close(self) -> _Step:
        self._closers.pop()
        self._pos += 1
        return self._value_done()

    def _value_done(self) -> _Step:
        if self._in_top_object() and self._open is not None:
            self._members.append(Member(*self._open, self._pos))
            self._open = None
        self._state = _AFTER_VALUE
        return _Step.MORE

    def _in_top_object(self) -> bool:
        return self._closers == ["}"]


def _malformed(at: int) -> ValueScan:
    return ValueScan(None, at, True)


def scan_value(text: str, start: int, depth: int = 0) -> ValueScan:
    """Scan the JSON value that begins at `text[start]` (no leading whitespace: skip it first).

    `depth` is how many containers already enclose the value (its own nesting counts on top).
    """
    return JsonScanner(start, depth).scan(text)


def scan_object(text: str, start: int, depth: int = 0) -> ObjectScan:
    """Scan the object that begins at `text[start]`, naming its top-level members.

    A member is listed once its value has begun (its first character is in the text); the last
    member's `end` is None while the text ends inside its value or where it turned malformed.
    """
    return JsonScanner(start, depth).scan_object(text)
