"""Tool-call output parsers: a model's generated text as `content` plus OpenAI tool calls.

One parser reads one choice's text, whole (an unstreamed response: one `feed`, then `finish`)
or piece by piece as it is generated (a streamed one: the `ToolCallDelta`s of each `feed` are
its `delta.tool_calls`). Both must give the same answer, however the text was split, so what a
parser emits is a function of the text alone: each feed reads the whole text so far into a
snapshot (the content and the calls that text makes certain, whatever comes next) and emits
what grew since the last one. Every format is written so that a snapshot only grows as the text
grows; `finish` reads the text as final, releasing what was held back because it might have
begun a call marker. The re-read stays cheap: content outside calls is found with `str.find`,
and the JSON scanners of one feed are kept for the next (the text only grows, so each goes on
where it stopped), so even a call with long arguments streams in linear time.

Formats (`make_parser`'s `fmt`). The model-family formats (`PARSER_FORMATS`, for
`tool_choice: "auto"`):
- "hermes" (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, anywhere; the text outside them is content;
- "llama3_json" (Llama 3.1/3.2): an output that begins (after whitespace and an optional
  `<|python_tag|>`) with `{` is one or more call objects separated by `;` and/or whitespace;
  any other output is content;
- "mistral": content, then `[TOOL_CALLS]` and a JSON array of call objects, or the newer
  `[TOOL_CALLS]name[ARGS]{...}`, possibly repeated.
A call object holds "name" (a JSON string) and "arguments" (or "parameters"), in either order.

The forced formats (`FORCED_FORMATS`, for "required" and a named function, where a grammar
forced the shape): "forced_required", the whole output a JSON array of call objects, never any
content; "forced_named", the whole output the arguments of the one call `forced_name`.

Rules every format shares:
- a call is emitted (its first delta, with id and name) once its name is a complete JSON string;
  arguments written before the name are held back until then;
- arguments are the raw JSON text of the value as the model wrote it (a substring of the
  output, never re-serialized); while the value is unfinished, the valid prefix scanned so far;
  if it turns malformed, they stop at the last valid character and the call stays. Arguments
  written as a JSON string (`"arguments": "{\\"a\\": 1}"`) are the decoded string, emitted
  once the string is complete ("" if it never is). A call object that ends (or the output
  ends) without any arguments member has arguments "{}";
- the first "name" and the first "arguments"/"parameters" member count; later duplicates do not;
- in the model-family formats, a call is rejected when its name is empty, not a string, never
  comes (the object ends, turns malformed, or the output ends first), or, when the request
  declared `tool_names`, is not one of them (the model made a function up). A rejected call is
  content, read as the model wrote it: the text from its call marker (`<tool_call>`,
  `[TOOL_CALLS]`) on is read again as content, marker included, or, in llama3_json, the whole
  output when it is the first object. When calls of the same region were already emitted (a
  mistral array, later llama3 objects), content starts at the rejected object instead;
- the forced formats check no names (the grammar allowed only declared ones) and drop a
  nameless object.

Where a region ends (content resumes after it):
- hermes: after the object, optional whitespace and `</tool_call>` (whitespace and a partial
  `</tool_call>` at the very end of the output are part of the call; a missing close tag is
  fine: content resumes right after the object). A call whose object turned malformed runs to
  the next `</tool_call>` (inclusive) or `<tool_call>` (exclusive), or to the end of the output;
- llama3_json: after each object, `;` and whitespace; any other text after the calls (or after
  the point where an object turned malformed, unless a new `{` follows) is content;
- mistral: after the array's `]` (an empty array is no call and no content) or the `[ARGS]`
  value; where the array or value turned malformed, content resumes at the offending character.

forced_named's arguments are the raw JSON value from the output's first non-whitespace
character, without the whitespace after it ("" for an output of whitespace only).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from uuid import uuid4

from controlplane.tools.json_scan import (
    JsonScanner,
    Member,
    ObjectScan,
    ValueScan,
    decode_string,
    skip_whitespace,
)

PARSER_FORMATS = ("hermes", "llama3_json", "mistral")
"""The model-family call formats, for `tool_choice: "auto"`."""
FORCED_FORMATS = ("forced_required", "forced_named")
"""The shapes a grammar forces for "required" and for a named function."""

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"

_ARGUMENT_KEYS = ("arguments", "parameters")
_MISSING_ARGUMENTS = "{}"
_LLAMA3_SEPARATORS = re.compile(r"[ \t\n\r;]*")
# A function name in the newer mistral format runs up to `[ARGS]`; OpenAI names are
# [A-Za-z0-9_-]{1,64}, but a declared name may hold dots or colons, so only what cannot be in a
# name ends it.
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}\"',]*")


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
class _Call:
    """A call as a snapshot sees it: its name and its arguments so far."""

    name: str
    arguments: str


@dataclass(frozen=True)
class _Snapshot:
    """What the text so far makes certain: its content and its calls, in order."""

    content: str
    calls: tuple[_Call, ...]


class _Verdict(Enum):
    CALL = "call"
    REJECTED = "rejected"
    PENDING = "pending"  # the name is not known yet


@dataclass(frozen=True)
class _CallObject:
    """A call object read so far: its name once known, and its arguments so far."""

    name: str | None
    nameless: bool  # it can never yield a usable name
    arguments: str


class _Scans:
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
        self._scans = _Scans()

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
    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        """What `text` makes certain; `final`: no more text follows."""

    def _advance(self, snapshot: _Snapshot) -> ParserOutput:
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


class _FamilyParser(ToolCallParser):
    """A model-family format: calls may be rejected by name, and rejected calls are content."""

    def __init__(self, new_id: Callable[[], str], tool_names: frozenset[str]) -> None:
        super().__init__(new_id)
        self._tool_names = tool_names

    def _verdict(self, call: _CallObject) -> _Verdict:
        if call.name is None:
            return _Verdict.REJECTED if call.nameless else _Verdict.PENDING
        return self._verdict_on_name(call.name)

    def _verdict_on_name(self, name: str) -> _Verdict:
        if self._tool_names and name not in self._tool_names:
            return _Verdict.REJECTED
        return _Verdict.CALL


def _read_call_object(text: str, obj: ObjectScan, final: bool) -> _CallObject:
    """A call object's name and arguments so far; `final`: the object can get no more text."""
    over = final or obj.end is not None or obj.malformed
    name, nameless = _read_name(text, obj.member("name"), over)
    args = obj.member(*_ARGUMENT_KEYS)
    if args is None:
        arguments = _MISSING_ARGUMENTS if over else ""
    else:
        arguments = _arguments_text(text, args.start, args.end, obj.valid_end)
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


def _arguments_text(text: str, start: int, end: int | None, frontier: int) -> str:
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


def _is_partial(text: str, start: int, marker: str) -> bool:
    """Whether `text[start:]` could still grow into `marker` (it is a prefix of it, or empty)."""
    return len(text) - start < len(marker) and marker.startswith(text[start:])


@dataclass(frozen=True)
class _Region:
    """How a call region after a marker reads: rejected (content), or its calls and where
    content resumes (None: the text ends inside the region, or the region runs to the end)."""

    rejected: bool
    calls: tuple[_Call, ...] = ()
    resume: int | None = None


_REJECTED = _Region(rejected=True)
_UNDECIDED = _Region(rejected=False)


class _MarkerParser(_FamilyParser):
    """Content with call regions, each opened by a marker (hermes, mistral)."""

    marker: str

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        content: list[str] = []
        calls: list[_Call] = []
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
        return _Snapshot("".join(content), tuple(calls))

    @abstractmethod
    def _region(self, text: str, body: int, final: bool) -> _Region:
        """The call region whose body begins at `text[body]`, just after the marker."""


class HermesParser(_MarkerParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, anywhere in the content."""

    marker = HERMES_OPEN

    def _region(self, text: str, body: int, final: bool) -> _Region:
        start = skip_whitespace(text, body)
        if start == len(text):
            return _REJECTED if final else _UNDECIDED
        if text[start] != "{":
            return _REJECTED
        obj = self._scans.object(text, start)
        call = _read_call_object(text, obj, final)
        verdict = self._verdict(call)
        if verdict is not _Verdict.CALL:
            return _REJECTED if verdict is _Verdict.REJECTED else _UNDECIDED
        assert call.name is not None
        return _Region(False, (_Call(call.name, call.arguments),), _hermes_resume(text, obj, final))


def _hermes_resume(text: str, obj: ObjectScan, final: bool) -> int | None:
    """Where content resumes after a hermes call's object. Whitespace after a call's close
    tag belongs to the call (models put a newline between calls): content resumes at the
    next other character, so it is held back until one comes (or the output ends)."""
    if obj.end is not None:
        after = skip_whitespace(text, obj.end)
        if text.startswith(HERMES_CLOSE, after):
            resume = skip_whitespace(text, after + len(HERMES_CLOSE))
            return None if resume == len(text) and not final else resume
        if _is_partial(text, after, HERMES_CLOSE):
            return None  # the close tag may be coming (or the output ended in it)
        return obj.end
    if not obj.malformed:
        return None
    close = text.find(HERMES_CLOSE, obj.valid_end)
    reopen = text.find(HERMES_OPEN, obj.valid_end)
    if reopen >= 0 and (close < 0 or reopen < close):
        return reopen
    return close + len(HERMES_CLOSE) if close >= 0 else None


class MistralParser(_MarkerParser):
    """`[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (repeated), after content."""

    marker = MISTRAL_TOOL_CALLS

    def _region(self, text: str, body: int, final: bool) -> _Region:
        start = skip_whitespace(text, body)
        if start == len(text):
            return _REJECTED if final else _UNDECIDED
        if text[start] == "[":
            return self._array_region(text, start, final)
        return self._named_region(text, start, final)

    def _array_region(self, text: str, start: int, final: bool) -> _Region:
        walk = _walk_call_array(self._scans, text, start)
        calls: list[_Call] = []
        for element_start, obj in walk.elements:
            call = _read_call_object(text, obj, final)
            verdict = self._verdict(call)
            if verdict is _Verdict.PENDING:
                return _Region(False, tuple(calls), None)
            if verdict is _Verdict.REJECTED:
                return _Region(False, tuple(calls), element_start) if calls else _REJECTED
            assert call.name is not None
            calls.append(_Call(call.name, call.arguments))
        if not calls and not walk.closed:
            # Not an array of objects, or one the output ended inside of before any element.
            return _REJECTED if final or walk.resume is not None else _UNDECIDED
        return _Region(False, tuple(calls), walk.resume)

    def _named_region(self, text: str, start: int, final: bool) -> _Region:
        match = _MISTRAL_NAME.match(text, start)
        assert match is not None
        name_end = match.end()
        args_tag = skip_whitespace(text, name_end)
        if name_end == start or not text.startswith(MISTRAL_ARGS, args_tag):
            if name_end == start or final or not _is_partial(text, args_tag, MISTRAL_ARGS):
                return _REJECTED
            return _UNDECIDED
        name = text[start:name_end]
        if self._verdict_on_name(name) is _Verdict.REJECTED:
            return _REJECTED
        value_start = skip_whitespace(text, args_tag + len(MISTRAL_ARGS))
        if value_start == len(text):
            return _Region(False, (_Call(name, _MISSING_ARGUMENTS if final else ""),), None)
        value = self._scans.value(text, value_start)
        arguments = _arguments_text(text, value_start, value.end, value.valid_end)
        resume = value.end if value.end is not None else (value.valid_end if value.malformed else None)
        return _Region(False, (_Call(name, arguments),), resume)


@dataclass(frozen=True)
class _ArrayWalk:
    """The objects of a JSON array of call objects, as far as the text goes."""

    elements: tuple[tuple[int, ObjectScan], ...]  # each object's start and scan
    resume: int | None  # past the `]`, or where it stopped being an array of objects; None: unfinished
    closed: bool  # ended with its `]`


def _walk_call_array(scans: _Scans, text: str, start: int) -> _ArrayWalk:
    """Walk the array that begins at `text[start]` ('['), element by element."""
    n = len(text)
    elements: list[tuple[int, ObjectScan]] = []

    def walk(resume: int | None, closed: bool = False) -> _ArrayWalk:
        return _ArrayWalk(tuple(elements), resume, closed)

    i = skip_whitespace(text, start + 1)
    if i < n and text[i] == "]":
        return walk(i + 1, closed=True)
    while True:
        if i == n:
            return walk(None)
        if text[i] != "{":
            return walk(i)
        obj = scans.object(text, i, depth=1)
        elements.append((i, obj))
        if obj.end is None:
            return walk(obj.valid_end if obj.malformed else None)
        i = skip_whitespace(text, obj.end)
        if i == n:
            return walk(None)
        if text[i] == "]":
            return walk(i + 1, closed=True)
        if text[i] != ",":
            return walk(i)
        i = skip_whitespace(text, i + 1)


class Llama3JsonParser(_FamilyParser):
    """Call objects separated by `;`, when the output begins with `{`; else all content."""

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        lead = skip_whitespace(text, 0)
        if text.startswith(LLAMA3_PYTHON_TAG, lead):
            start = skip_whitespace(text, lead + len(LLAMA3_PYTHON_TAG))
        elif not final and _is_partial(text, lead, LLAMA3_PYTHON_TAG):
            return _Snapshot("", ())  # whitespace, or what may become the python tag
        else:
            start = lead
        if start == len(text):
            return _Snapshot(text if final else "", ())
        if text[start] != "{":
            return _Snapshot(text, ())
        return self._read_calls(text, start, final)

    def _read_calls(self, text: str, start: int, final: bool) -> _Snapshot:
        calls: list[_Call] = []
        i = start
        while True:
            obj = self._scans.object(text, i)
            call = _read_call_object(text, obj, final)
            verdict = self._verdict(call)
            if verdict is _Verdict.PENDING:
                return _Snapshot("", tuple(calls))
            if verdict is _Verdict.REJECTED:
                return _Snapshot(text[i:] if calls else text, tuple(calls))
            assert call.name is not None
            calls.append(_Call(call.name, call.arguments))
            resume = obj.end if obj.end is not None else (obj.valid_end if obj.malformed else None)
            if resume is None:
                return _Snapshot("", tuple(calls))
            match = _LLAMA3_SEPARATORS.match(text, resume)
            assert match is not None
            i = match.end()
            if i == len(text):
                return _Snapshot("", tuple(calls))
            if text[i] != "{":
                return _Snapshot(text[i:], tuple(calls))


class ForcedRequiredParser(ToolCallParser):
    """The whole output a JSON array of call objects (a grammar forced it); never content."""

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        start = skip_whitespace(text, 0)
        if start == len(text) or text[start] != "[":
            return _Snapshot("", ())
        calls: list[_Call] = []
        for _, obj in _walk_call_array(self._scans, text, start).elements:
            call = _read_call_object(text, obj, final)
            if call.name is None:
                if call.nameless:
                    continue
                break
            calls.append(_Call(call.name, call.arguments))
        return _Snapshot("", tuple(calls))


class ForcedNamedParser(ToolCallParser):
    """The whole output the arguments of one call of a named function (a grammar forced it).

    The call is emitted on the first feed, whatever its text; its arguments are the raw JSON
    value from the first non-whitespace character, without the whitespace after it.
    """

    def __init__(self, new_id: Callable[[], str], name: str) -> None:
        super().__init__(new_id)
        self._name = name

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        start = skip_whitespace(text, 0)
        arguments = ""
        if start < len(text):
            arguments = text[start : self._scans.value(text, start).valid_end]
        return _Snapshot("", (_Call(self._name, arguments),))


def make_parser(
    fmt: str,
    new_id: Callable[[], str],
    *,
    tool_names: Collection[str] = (),
    forced_name: str | None = None,
) -> ToolCallParser:
    """The parser of one choice's output in format `fmt` (PARSER_FORMATS or FORCED_FORMATS).

    `new_id` gives each call its id; `tool_names` are the request's declared functions (the
    model-family formats reject a call of any other; empty: any name); `forced_name` is the
    function of "forced_named".
    """
    names = frozenset(tool_names)
    if fmt == "hermes":
        return HermesParser(new_id, names)
    if fmt == "llama3_json":
        return Llama3JsonParser(new_id, names)
    if fmt == "mistral":
        return MistralParser(new_id, names)
    if fmt == "forced_required":
        return ForcedRequiredParser(new_id)
    if fmt == "forced_named":
        if forced_name is None:
            raise ValueError('the "forced_named" format needs forced_name')
        return ForcedNamedParser(new_id, forced_name)
    raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {PARSER_FORMATS + FORCED_FORMATS}")
