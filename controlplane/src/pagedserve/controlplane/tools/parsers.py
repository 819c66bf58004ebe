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
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pagedserve.controlplane.tools.json_scan import (
    ObjectScan,
    skip_whitespace,
)
from pagedserve.controlplane.tools.parser_base import (
    MISSING_ARGUMENTS,
    REJECTED,
    UNDECIDED,
    FamilyParser,
    MarkerParser,
    ParsedCall,
    ParserOutput,
    Region,
    Scans,
    Snapshot,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    Verdict,
    arguments_text,
    default_call_id,
    is_partial,
    read_call_object,
)

__all__ = [
    "FORCED_FORMATS",
    "PARSER_FORMATS",
    "ParserOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "default_call_id",
    "make_parser",
]

PARSER_FORMATS = ("hermes", "llama3_json", "mistral")
"""The model-family call formats, for `tool_choice: "auto"`."""
FORCED_FORMATS = ("forced_required", "forced_named")
"""The shapes a grammar forces for "required" and for a named function."""

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"

_LLAMA3_SEPARATORS = re.compile(r"[ \t\n\r;]*")
# A function name in the newer mistral format runs up to `[ARGS]`; OpenAI names are
# [A-Za-z0-9_-]{1,64}, but a declared name may hold dots or colons, so only what cannot be in a
# name ends it.
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}\"',]*")


class HermesParser(MarkerParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, anywhere in the content."""

    marker = HERMES_OPEN

    def _region(self, text: str, body: int, final: bool) -> Region:
        start = skip_whitespace(text, body)
        if start == len(text):
            return REJECTED if final else UNDECIDED
        if text[start] != "{":
            return REJECTED
        obj = self._scans.object(text, start)
        call = read_call_object(text, obj, final)
        verdict = self._verdict(call)
        if verdict is not Verdict.CALL:
            return REJECTED if verdict is Verdict.REJECTED else UNDECIDED
        assert call.name is not None
        return Region(False, (ParsedCall(call.name, call.arguments),), _hermes_resume(text, obj, final))


def _hermes_resume(text: str, obj: ObjectScan, final: bool) -> int | None:
    """Where content resumes after a hermes call's object. Whitespace after a call's close
    tag belongs to the call (models put a newline between calls): content resumes at the
    next other character, so it is held back until one comes (or the output ends)."""
    if obj.end is not None:
        after = skip_whitespace(text, obj.end)
        if text.startswith(HERMES_CLOSE, after):
            resume = skip_whitespace(text, after + len(HERMES_CLOSE))
            return None if resume == len(text) and not final else resume
        if is_partial(text, after, HERMES_CLOSE):
            return None  # the close tag may be coming (or the output ended in it)
        return obj.end
    if not obj.malformed:
        return None
    close = text.find(HERMES_CLOSE, obj.valid_end)
    reopen = text.find(HERMES_OPEN, obj.valid_end)
    if reopen >= 0 and (close < 0 or reopen < close):
        return reopen
    return close + len(HERMES_CLOSE) if close >= 0 else None


class MistralParser(MarkerParser):
    """`[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (repeated), after content."""

    marker = MISTRAL_TOOL_CALLS

    def _region(self, text: str, body: int, final: bool) -> Region:
        start = skip_whitespace(text, body)
        if start == len(text):
            return REJECTED if final else UNDECIDED
        if text[start] == "[":
            return self._array_region(text, start, final)
        return self._named_region(text, start, final)

    def _array_region(self, text: str, start: int, final: bool) -> Region:
        walk = _walk_call_array(self._scans, text, start)
        calls: list[ParsedCall] = []
        for element_start, obj in walk.elements:
            call = read_call_object(text, obj, final)
            verdict = self._verdict(call)
            if verdict is Verdict.PENDING:
                return Region(False, tuple(calls), None)
            if verdict is Verdict.REJECTED:
                return Region(False, tuple(calls), element_start) if calls else REJECTED
            assert call.name is not None
            calls.append(ParsedCall(call.name, call.arguments))
        if not calls and not walk.closed:
            # Not an array of objects, or one the output ended inside of before any element.
            return REJECTED if final or walk.resume is not None else UNDECIDED
        return Region(False, tuple(calls), walk.resume)

    def _named_region(self, text: str, start: int, final: bool) -> Region:
        match = _MISTRAL_NAME.match(text, start)
        assert match is not None
        name_end = match.end()
        args_tag = skip_whitespace(text, name_end)
        if name_end == start or not text.startswith(MISTRAL_ARGS, args_tag):
            if name_end == start or final or not is_partial(text, args_tag, MISTRAL_ARGS):
                return REJECTED
            return UNDECIDED
        name = text[start:name_end]
        if self._verdict_on_name(name) is Verdict.REJECTED:
            return REJECTED
        value_start = skip_whitespace(text, args_tag + len(MISTRAL_ARGS))
        if value_start == len(text):
            return Region(False, (ParsedCall(name, MISSING_ARGUMENTS if final else ""),), None)
        value = self._scans.value(text, value_start)
        arguments = arguments_text(text, value_start, value.end, value.valid_end)
        resume = value.end if value.end is not None else (value.valid_end if value.malformed else None)
        return Region(False, (ParsedCall(name, arguments),), resume)


@dataclass(frozen=True)
class _ArrayWalk:
    """The objects of a JSON array of call objects, as far as the text goes."""

    elements: tuple[tuple[int, ObjectScan], ...]  # each object's start and scan
    resume: int | None  # past the `]`, or where it stopped being an array of objects; None: unfinished
    closed: bool  # ended with its `]`


def _walk_call_array(scans: Scans, text: str, start: int) -> _ArrayWalk:
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


class Llama3JsonParser(FamilyParser):
    """Call objects separated by `;`, when the output begins with `{`; else all content."""

    def _snapshot(self, text: str, final: bool) -> Snapshot:
        lead = skip_whitespace(text, 0)
        if text.startswith(LLAMA3_PYTHON_TAG, lead):
            start = skip_whitespace(text, lead + len(LLAMA3_PYTHON_TAG))
        elif not final and is_partial(text, lead, LLAMA3_PYTHON_TAG):
            return Snapshot("", ())  # whitespace, or what may become the python tag
        else:
            start = lead
        if start == len(text):
            return Snapshot(text if final else "", ())
        if text[start] != "{":
            return Snapshot(text, ())
        return self._read_calls(text, start, final)

    def _read_calls(self, text: str, start: int, final: bool) -> Snapshot:
        calls: list[ParsedCall] = []
        i = start
        while True:
            obj = self._scans.object(text, i)
            call = read_call_object(text, obj, final)
            verdict = self._verdict(call)
            if verdict is Verdict.PENDING:
                return Snapshot("", tuple(calls))
            if verdict is Verdict.REJECTED:
                return Snapshot(text[i:] if calls else text, tuple(calls))
            assert call.name is not None
            calls.append(ParsedCall(call.name, call.arguments))
            resume = obj.end if obj.end is not None else (obj.valid_end if obj.malformed else None)
            if resume is None:
                return Snapshot("", tuple(calls))
            match = _LLAMA3_SEPARATORS.match(text, resume)
            assert match is not None
            i = match.end()
            if i == len(text):
                return Snapshot("", tuple(calls))
            if text[i] != "{":
                return Snapshot(text[i:], tuple(calls))


class ForcedRequiredParser(ToolCallParser):
    """The whole output a JSON array of call objects (a grammar forced it); never content."""

    def _snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_whitespace(text, 0)
        if start == len(text) or text[start] != "[":
            return Snapshot("", ())
        calls: list[ParsedCall] = []
        for _, obj in _walk_call_array(self._scans, text, start).elements:
            call = read_call_object(text, obj, final)
            if call.name is None:
                if call.nameless:
                    continue
                break
            calls.append(ParsedCall(call.name, call.arguments))
        return Snapshot("", tuple(calls))


class ForcedNamedParser(ToolCallParser):
    """The whole output the arguments of one call of a named function (a grammar forced it).

    The call is emitted on the first feed, whatever its text; its arguments are the raw JSON
    value from the first non-whitespace character, without the whitespace after it.
    """

    def __init__(self, new_id: Callable[[], str], name: str) -> None:
        super().__init__(new_id)
        self._name = name

    def _snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_whitespace(text, 0)
        arguments = ""
        if start < len(text):
            arguments = text[start : self._scans.value(text, start).valid_end]
        return Snapshot("", (ParsedCall(self._name, arguments),))


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
