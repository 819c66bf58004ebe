"""What every tool-call parser shares: the public values (a call, its streamed pieces, a
feed's output), the base class that turns a re-scanned text into growing deltas, and the
reading of one call object out of JSON scans. The formats themselves are in parsers.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from uuid import uuid4

from pagedserve.controlplane.tools.json_scan import (
    JsonScanner,
    Member,
    ObjectScan,
    ValueScan,
    decode_string,
)

_ARGUMENT_KEYS = ("arguments", "parameters")
MISSING_ARGUMENTS = "{}"


def default_call_id() -> str:
    """A fresh call id in OpenAI's shape: "call_" and 24 hex digits."""
    return f"call_{uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of one call, as OpenAI streams it in `delta.tool_calls`."""

    index: int  # the call's position among this choice's calls (0, 1, ...)
    id: str | None  # the call's id, on the call's first delta only
    name: str | None  # the function name, on the call's first delta only
    arguments: str  # the next piece of the arguments' JSON text ("" allowed)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments (an object's text as the model wrote it)


@dataclass(frozen=True)
class ParserOutput:
    content: str  # new content text (outside any call) since the last feed
    calls: tuple[ToolCallDelta, ...]


_NOTHING = ParserOutput("", ())


@dataclass(frozen=True)
class ParsedCall:
    """A call as a snapshot sees it: its name and its arguments so far."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Snapshot:
    """What the text so far makes certain: its content and its calls, in order."""

    content: str
    calls: tuple[ParsedCall, ...]


class Verdict(Enum):
    CALL = "call"
    REJECTED = "rejected"
    PENDING = "pending"  # the name is not known yet


@dataclass(frozen=True)
class _CallObject:
    """A call object read so far: its name once known, and its arguments so far."""

    name: str | None
    nameless: bool  # it can never yield a usable name
    arguments: str


class Scans:
    """The JSON scanners of one parser's text, by where their value starts (and its depth).

    The text only grows, so a value scanned on one feed goes on from where it stopped on the
    next: a long call streams in linear time, not quadratic. The answers are those of a fresh
    scan, so a snapshot stays a function of the text alone.
    """

    def __init__(self) -> None:
        self._scanners: dict[tuple[int, int], JsonScanner] = {}

    def _scanner(self, start: int, depth: int) -> JsonScanner:
        scanner = self._scanners.get((start, depth))
        if scanner is None:
            scanner = self._scanners[(start, depth)] = JsonScanner(start, depth)
        return scanner

    def value(self, text: str, start: int) -> ValueScan:
        return self._scanner(start, 0).scan(text)

    def object(self, text: str, start: int, depth: int = 0) -> ObjectScan:
        return self._scanner(start, depth).scan_object(text)


class ToolCallParser(ABC):
    """Reads one choice's generated text; see the module docstring for the formats and rules."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._text = ""
        self._fed = False
        self._finished = False
        self._content = ""
        self._calls: list[ToolCall] = []
        self._scans = Scans()

    def feed(self, text: str) -> ParserOutput:
        """The content and call pieces that `text`, the next piece of the output, makes certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not text and self._fed:
            return _NOTHING
        self._fed = True
        self._text += text
        return self._advance(self._snapshot(self._text, final=False))

    def finish(self) -> ParserOutput:
        """The end of the output: what was held back (a second call returns nothing)."""
        if self._finished:
            return _NOTHING
        self._finished = True
        return self._advance(self._snapshot(self._text, final=True))

    @property
    def content(self) -> str:
        """All content emitted so far."""
        return self._content

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls emitted so far, with their arguments as emitted so far."""
        return list(self._calls)

    @abstractmethod
    def _snapshot(self, text: str, final: bool) -> Snapshot:
        """What `text` makes certain; `final`: no more text follows."""

    def _advance(self, snapshot: Snapshot) -> ParserOutput:
        """Emit how `snapshot` extends what was emitted.

        Snapshots only grow (each format is written so); a part that did not extend what was
        emitted would contribute nothing rather than contradict a delta already sent.
        """
        content = _growth(self._content, snapshot.content)
        self._content += content
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(snapshot.calls):
            if index < len(self._calls):
                known = self._calls[index]
                piece = _growth(known.arguments, call.arguments) if known.name == call.name else ""
                if piece:
                    self._calls[index] = ToolCall(known.id, known.name, known.arguments + piece)
                    deltas.append(ToolCallDelta(index, None, None, piece))
            else:
                new = ToolCall(self._new_id(), call.name, call.arguments)
                self._calls.append(new)
                deltas.append(ToolCallDelta(index, new.id, new.name, new.arguments))
        return ParserOutput(content, tuple(deltas))


def _growth(old: str, new: str) -> str:
    return new[len(old) :] if new.startswith(old) else ""


class FamilyParser(ToolCallParser):
    """A model-family format: calls may be rejected by name, and rejected calls are content."""

    def __init__(self, new_id: Callable[[], str], tool_names: frozenset[str]) -> None:
        super().__init__(new_id)
        self._tool_names = tool_names

    def _verdict(self, call: _CallObject) -> Verdict:
        if call.name is None:
            return Verdict.REJECTED if call.nameless else Verdict.PENDING
        return self._verdict_on_name(call.name)

    def _verdict_on_name(self, name: str) -> Verdict:
        if self._tool_names and name not in self._tool_names:
            return Verdict.REJECTED
        return Verdict.CALL


def read_call_object(text: str, obj: ObjectScan, final: bool) -> _CallObject:
    """A call object's name and arguments so far; `final`: the object can get no more text."""
    over = final or obj.end is not None or obj.malformed
    name, nameless = _read_name(text, obj.member("name"), over)
    args = obj.member(*_ARGUMENT_KEYS)
    if args is None:
        arguments = MISSING_ARGUMENTS if over else ""
    else:
        arguments = arguments_text(text, args.start, args.end, obj.valid_end)
    return _CallObject(name, nameless, arguments)


def _read_name(text: str, member: Member | None, over: bool) -> tuple[str | None, bool]:
    """(the name or None, whether the object can never yield one)."""
    if member is None or member.end is None:
        # An unfinished name string is lost when its object (or the output) is over.
        nameless = over or (member is not None and text[member.start] != '"')
        return None, nameless
    if text[member.start] != '"':
        return None, True
    name = decode_string(text, member.start, member.end)
    return (name, False) if name else (None, True)


def arguments_text(text: str, start: int, end: int | None, frontier: int) -> str:
    """The arguments of a value at `start`: raw JSON up to its end (or up to `frontier`, the
    valid prefix's end, while it is unfinished); a JSON string's decoded value once complete."""
    if start < len(text) and text[start] == '"':
        return decode_string(text, start, end) if end is not None else ""
    return text[start : frontier if end is None else end]


def _content_until(text: str, start: int, marker: str, final: bool) -> tuple[str, int | None]:
    """The content from `start` to the next `marker`, and the marker's index (None if absent).

    Without the marker, a tail of the text that could be its beginning is held back (not
    content yet) unless the text is final.
    """
    found = text.find(marker, start)
    if found >= 0:
        return text[start:found], found
    end = len(text) if final else len(text) - _partial_marker(text, start, marker)
    return text[start:end], None


def _partial_marker(text: str, start: int, marker: str) -> int:
    """The length of the longest tail of `text[start:]` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def is_partial(text: str, start: int, marker: str) -> bool:
    """Whether `text[start:]` could still grow into `marker` (it is a prefix of it, or empty)."""
    return len(text) - start < len(marker) and marker.startswith(text[start:])


@dataclass(frozen=True)
class Region:
    """How a call region after a marker reads: rejected (content), or its calls and where
    content resumes (None: the text ends inside the region, or the region runs to the end)."""

    rejected: bool
    calls: tuple[ParsedCall, ...] = ()
    resume: int | None = None


REJECTED = Region(rejected=True)
UNDECIDED = Region(rejected=False)


class MarkerParser(FamilyParser):
    """Content with call regions, each opened by a marker (hermes, mistral)."""

    marker: str

    def _snapshot(self, text: str, final: bool) -> Snapshot:
        content: list[str] = []
        calls: list[ParsedCall] = []
        i: int | None = 0
        while i is not None:
            piece, found = _content_until(text, i, self.marker, final)
            content.append(piece)
            if found is None:
                break
            body = found + len(self.marker)
            region = self._region(text, body, final)
            if region.rejected:
                content.append(self.marker)
                i = body
                continue
            calls.extend(region.calls)
            i = region.resume
        return Snapshot("".join(content), tuple(calls))

    @abstractmethod
    def _region(self, text: str, body: int, final: bool) -> Region:
        """The call region whose body begins at `text[body]`, just after the marker."""
