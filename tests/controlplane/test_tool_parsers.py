"""Tool-call output parsers and their JSON scanner: exact answers per format, and the property
that matters most: however a text is split into fed pieces, the content and the calls come out
the same as when it is fed whole (each call's first delta with its id and name, later deltas
without them)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.controlplane.tools.json_scan import (
    MAX_DEPTH,
    JsonScanner,
    Member,
    decode_string,
    scan_object,
    scan_value,
)
from pagedserve.controlplane.tools.parsers import (
    FORCED_FORMATS,
    PARSER_FORMATS,
    ParserOutput,
    ToolCallDelta,
    ToolCallParser,
    default_call_id,
    make_parser,
)

TOOLS = ("get_weather", "search")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SEARCH = '{"name": "search", "arguments": {"q": "cats"}}'


def counter_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parser(fmt: str, **kwargs: Any) -> ToolCallParser:
    return make_parser(fmt, counter_ids(), **kwargs)


def run(p: ToolCallParser, pieces: Sequence[str]) -> list[ParserOutput]:
    return [p.feed(piece) for piece in pieces] + [p.finish()]


def whole(fmt: str, text: str, **kwargs: Any) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of `text` fed whole."""
    p = parser(fmt, **kwargs)
    run(p, [text])
    return p.content, [(c.name, c.arguments) for c in p.tool_calls]


def chars(fmt: str, text: str, **kwargs: Any) -> tuple[str, list[tuple[str, str]]]:
    """The same, fed one character at a time (and checked against the whole-text answer)."""
    p = parser(fmt, **kwargs)
    outs = run(p, list(text))
    content, calls = assemble(outs)
    assert (content, calls) == whole(fmt, text, **kwargs)
    return content, calls


def assemble(outs: Sequence[ParserOutput]) -> tuple[str, list[tuple[str, str]]]:
    """Join streamed outputs as a client would, checking the delta shape on the way."""
    content = "".join(o.content for o in outs)
    names: list[str] = []
    arguments: list[str] = []
    ids: set[str] = set()
    for delta in (d for o in outs for d in o.calls):
        if delta.index == len(names):
            assert delta.id is not None and delta.name is not None, delta
            assert delta.id not in ids
            ids.add(delta.id)
            names.append(delta.name)
            arguments.append(delta.arguments)
        else:
            assert delta.index < len(names), delta
            assert delta.id is None and delta.name is None, delta
            arguments[delta.index] += delta.arguments
    return content, list(zip(names, arguments, strict=True))


# --- the JSON scanner -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ('{"a": [1, 2.5e-3, true, false, null, "x\\"\\\\\\u00e9"]} tail', 52),
        ("[]", 2),
        ("{}", 2),
        ('"ab"c', 4),
        ("01", 1),  # a number ends where it cannot go on; what follows is the caller's
        ("-0.5E+2,", 7),
        ("true]", 4),
    ],
)
def test_scan_value_complete(text: str, end: int) -> None:
    scan = scan_value(text, 0)
    assert (scan.end, scan.valid_end, scan.malformed) == (end, end, False)


@pytest.mark.parametrize(
    "text", ["", "{", '{"a', '{"a":', '{"a": 1', "[1, ", "12", "-", "1.", "1e", "1e+", "tr", '"\\', '"\\u12']
)
def test_scan_value_incomplete(text: str) -> None:
    scan = scan_value(text, 0)
    assert (scan.end, scan.valid_end, scan.malformed) == (None, len(text), False)


@pytest.mark.parametrize(
    ("text", "at"),
    [
        ('{"a": tx', 7),
        ("[1,]", 3),
        ('"a\\x"', 3),
        ('"\\u12g"', 5),
        ("1.x", 2),
        ("-a", 1),
        ('{"a" 1}', 5),
        ("[1 2]", 3),
        ("[1}", 2),
        ('{"a": 1,}', 8),
        ('"a\nb"', 2),  # a raw control character in a string
        ("nul!", 3),
        ("}", 0),
    ],
)
def test_scan_value_malformed_at_the_first_offending_character(text: str, at: int) -> None:
    scan = scan_value(text, 0)
    assert (scan.end, scan.valid_end, scan.malformed) == (None, at, True)


def test_depth_limit_without_recursion() -> None:
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert scan_value(deepest, 0).end == len(deepest)
    assert scan_value("[" * (MAX_DEPTH + 1), 0).valid_end == MAX_DEPTH
    assert scan_value("[" * (MAX_DEPTH + 1), 0).malformed
    huge = '{"a": ' * 100_000
    assert scan_value(huge, 0).malformed
    assert scan_object('{"a": ' + "[" * MAX_DEPTH, 0).malformed  # the object counts as a level


def test_scan_object_members_and_raw_spans() -> None:
    text = '{"arguments": {"a": [1]}, "n\\u0061me": "f", "name": "g"}'
    obj = scan_object(text, 0)
    assert obj.end == len(text) and not obj.malformed
    assert [m.key for m in obj.members] == ["arguments", "name", "name"]
    args = obj.member("arguments", "parameters")
    assert args is not None and args.end is not None
    assert text[args.start : args.end] == '{"a": [1]}'
    assert obj.member("name") == Member("name", text.index('"f"'), text.index('"f"') + 3)


def test_scan_object_partial_member() -> None:
    text = '{"name": "f", "arguments": {"a": 1'
    obj = scan_object(text, 0)
    assert (obj.end, obj.valid_end, obj.malformed) == (None, len(text), False)
    assert obj.members[-1] == Member("arguments", text.index("{", 1), None)
    assert scan_object('{"name": "f", "arg', 0).members == (Member("name", 9, 12),)


def test_decoded_strings_are_unicode_text() -> None:
    pair, lone = '"\\ud83d\\ude00"', '"a\\ud800b"'
    assert decode_string(pair, 0, len(pair)) == "\U0001f600"
    assert decode_string(lone, 0, len(lone)) == "a\ufffdb"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(json_values, st.booleans())
def test_scanned_json_ends_where_it_ends_and_every_prefix_is_incomplete(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert scan_value(text + " x", 0).end == len(text)
    for cut in range(len(text)):
        scan = scan_value(text[:cut], 0)
        assert (scan.end, scan.valid_end, scan.malformed) == (None, cut, False)


def _no_constants(name: str) -> None:
    raise ValueError(name)


JSONISH = st.text(alphabet='{}[]",:0123456789.-+eE \n\\u"truefalsn', min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(JSONISH)
def test_scanner_agrees_with_json_loads(text: str) -> None:
    text = text.strip()
    if not text:
        return
    try:
        json.loads(text, parse_constant=_no_constants)
        valid = True
    except ValueError:
        valid = False
    # A terminator after the text, so that a number at its end is complete.
    scan = scan_value(text + " ", 0)
    assert (scan.end == len(text)) == valid
    plain = scan_value(text, 0)
    if plain.malformed:
        # The valid prefix is valid (incomplete), one character more is not.
        assert not scan_value(text[: plain.valid_end], 0).malformed
        assert scan_value(text[: plain.valid_end + 1], 0).malformed


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values.map(json.dumps), JSONISH), st.lists(st.integers(0, 10_000), max_size=8))
def test_a_resumed_scan_answers_as_a_fresh_one(text: str, cuts: list[int]) -> None:
    value, obj = JsonScanner(0), JsonScanner(0)
    for cut in [*sorted(c % (len(text) + 1) for c in cuts), len(text)]:
        assert value.scan(text[:cut]) == scan_value(text[:cut], 0)
        assert obj.scan_object(text[:cut]) == scan_object(text[:cut], 0)


# --- hermes ---------------------------------------------------------------------------------


def test_hermes_content_then_call() -> None:
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert chars("hermes", text, tool_names=TOOLS) == (
        "Let me check.",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_hermes_two_calls_and_the_text_between_them() -> None:
    # whitespace after a close tag belongs to the call; other text after it is content
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{SEARCH}\n</tool_call>\n"
    assert chars("hermes", text, tool_names=TOOLS) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')],
    )
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n\nDone. <tool_call>\n{SEARCH}\n</tool_call>"
    assert chars("hermes", text, tool_names=TOOLS) == (
        "Done. ",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')],
    )


def test_hermes_arguments_before_the_name_wait_for_it() -> None:
    text = '<tool_call>{"arguments": {"q": "cats"}, "name": "search"}</tool_call>'
    p = parser("hermes")
    before_name = text.index('"search"') + len('"search')
    assert p.feed(text[:before_name]) == ParserOutput("", ())
    out = p.feed(text[before_name:])
    assert out.calls == (ToolCallDelta(0, "call_0", "search", '{"q": "cats"}'),)
    assert p.finish() == ParserOutput("", ())


def test_hermes_string_arguments_are_decoded_once_complete() -> None:
    text = '<tool_call>{"name": "search", "parameters": "{\\"q\\": \\"cats\\"}"}</tool_call>'
    p = parser("hermes")
    outs = run(p, list(text))
    argument_pieces = [d.arguments for o in outs for d in o.calls if d.arguments]
    assert argument_pieces == ['{"q": "cats"}']
    assert assemble(outs) == ("", [("search", '{"q": "cats"}')])


def test_hermes_missing_arguments_and_missing_close_tag() -> None:
    assert chars("hermes", '<tool_call>{"name": "search"}') == ("", [("search", "{}")])
    truncated = '<tool_call>{"name": "search", "arguments": {"q": "ca'
    assert chars("hermes", truncated) == ("", [("search", '{"q": "ca')])
    two = f"<tool_call>{WEATHER}\n<tool_call>{SEARCH}</tool_call>"
    assert chars("hermes", two) == ("\n", [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')])


def test_hermes_malformed_arguments_stop_at_the_last_valid_point() -> None:
    text = 'a<tool_call>{"name": "search", "arguments": {"q": 1,, "r": 2}}</tool_call> after'
    assert chars("hermes", text) == ("a after", [("search", '{"q": 1,')])


def test_hermes_a_region_without_a_name_is_content_as_written() -> None:
    text = "x<tool_call>not json</tool_call> y"
    assert chars("hermes", text) == (text, [])
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert chars("hermes", nameless) == (nameless, [])
    # Cut off before the name: held until the end, then flushed as content.
    p = parser("hermes")
    assert p.feed('x<tool_call>{"argu') == ParserOutput("x", ())
    assert p.finish() == ParserOutput('<tool_call>{"argu', ())


def test_hermes_holds_back_a_partial_marker() -> None:
    p = parser("hermes")
    assert p.feed("a <tool_") == ParserOutput("a ", ())
    assert p.finish() == ParserOutput("<tool_", ())
    p = parser("hermes")
    assert p.feed("a <tool_") == ParserOutput("a ", ())
    assert p.feed("box>") == ParserOutput("<tool_box>", ())


def test_hermes_unknown_tool_names_are_content() -> None:
    text = f'Hi<tool_call>{{"name": "launch_rockets", "arguments": {{}}}}</tool_call><tool_call>{SEARCH}</tool_call>'
    content, calls = chars("hermes", text, tool_names=TOOLS)
    assert content == 'Hi<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
    assert calls == [("search", '{"q": "cats"}')]
    # Without declared names any name is a call; an empty name never is.
    assert whole("hermes", text)[1][0] == ("launch_rockets", "{}")
    empty = '<tool_call>{"name": "", "arguments": {}}</tool_call>'
    assert whole("hermes", empty) == (empty, [])


# --- llama3_json ----------------------------------------------------------------------------


def test_llama3_python_tag_and_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "search", "arguments": {"q": "cats"}}'
    )
    assert chars("llama3_json", text, tool_names=TOOLS) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')],
    )


def test_llama3_plain_content() -> None:
    assert chars("llama3_json", "  The weather is nice.") == ("  The weather is nice.", [])
    p = parser("llama3_json")
    assert p.feed("  ") == ParserOutput("", ())  # may still begin a call
    assert p.feed("<|pyth") == ParserOutput("", ())
    assert p.feed("on") == ParserOutput("", ())
    assert p.feed("!") == ParserOutput("  <|python!", ())
    built_in = '<|python_tag|>brave_search.call(query="x")'
    assert chars("llama3_json", built_in) == (built_in, [])


def test_llama3_trailing_text_and_rejected_objects() -> None:
    text = f"{WEATHER};\n Done."
    assert chars("llama3_json", text) == ("Done.", [("get_weather", '{"city": "Paris"}')])
    unknown = ' {"name": "launch_rockets", "parameters": {}}'
    assert chars("llama3_json", unknown, tool_names=TOOLS) == (unknown, [])
    answer = '{"answer": 42}'
    assert chars("llama3_json", answer) == (answer, [])
    later = f'{WEATHER}; {{"name": "launch_rockets", "parameters": {{}}}}'
    assert chars("llama3_json", later, tool_names=TOOLS) == (
        '{"name": "launch_rockets", "parameters": {}}',
        [("get_weather", '{"city": "Paris"}')],
    )


# --- mistral --------------------------------------------------------------------------------


def test_mistral_array_format() -> None:
    text = f"Sure.[TOOL_CALLS] [{WEATHER}, {SEARCH}]"
    assert chars("mistral", text, tool_names=TOOLS) == (
        "Sure.",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')],
    )


def test_mistral_name_args_format_repeated() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "cats"}'
    assert chars("mistral", text, tool_names=TOOLS) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "cats"}')],
    )


def test_mistral_holds_back_a_partial_marker_and_rejects_unknown_names() -> None:
    p = parser("mistral")
    assert p.feed("ok [TOOL_") == ParserOutput("ok ", ())
    assert p.finish() == ParserOutput("[TOOL_", ())
    unknown = "[TOOL_CALLS]launch_rockets[ARGS]{}"
    assert chars("mistral", unknown, tool_names=TOOLS) == (unknown, [])
    array = '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}]'
    assert chars("mistral", array, tool_names=TOOLS) == (array, [])
    markdown = "see [the docs](x)"
    assert chars("mistral", markdown) == (markdown, [])


# --- the forced formats ---------------------------------------------------------------------


def test_forced_required_arrays() -> None:
    assert chars("forced_required", f"[{WEATHER}]") == ("", [("get_weather", '{"city": "Paris"}')])
    spaced = f'[\n  {WEATHER} ,\n  {{"name":"search","arguments":{{"q":"cats"}}}}\n]\n'
    assert chars("forced_required", spaced) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("search", '{"q":"cats"}')],
    )


def test_forced_named_emits_the_call_on_the_first_feed() -> None:
    p = parser("forced_named", forced_name="get_weather")
    assert p.feed("") == ParserOutput("", (ToolCallDelta(0, "call_0", "get_weather", ""),))
    assert p.feed(" \n") == ParserOutput("", ())
    assert p.feed('{"city": ') == ParserOutput("", (ToolCallDelta(0, None, None, '{"city": '),))
    assert p.feed('"Paris"}\n  ') == ParserOutput("", (ToolCallDelta(0, None, None, '"Paris"}'),))
    assert p.finish() == ParserOutput("", ())
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert p.content == ""


# --- deltas, ids, the factory ---------------------------------------------------------------


def test_per_chunk_deltas() -> None:
    p = parser("hermes", tool_names=TOOLS)
    outs = run(
        p,
        ["Hi<tool_call>", '{"name": "get_', 'weather", "argu', 'ments": {"city"', ': "Paris"}}</tool_call>'],
    )
    assert outs == [
        ParserOutput("Hi", ()),
        ParserOutput("", ()),
        ParserOutput("", (ToolCallDelta(0, "call_0", "get_weather", ""),)),
        ParserOutput("", (ToolCallDelta(0, None, None, '{"city"'),)),
        ParserOutput("", (ToolCallDelta(0, None, None, ': "Paris"}'),)),
        ParserOutput("", ()),
    ]
    assert [(c.id, c.name, c.arguments) for c in p.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}')
    ]


def test_factory_and_lifecycle() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", default_call_id())
    assert default_call_id() != default_call_id()
    with pytest.raises(ValueError, match="unknown tool-call format"):
        make_parser("pythonic", default_call_id)
    with pytest.raises(ValueError, match="forced_name"):
        make_parser("forced_named", default_call_id)
    p = parser("hermes")
    p.feed("x")
    p.finish()
    assert p.finish() == ParserOutput("", ())
    with pytest.raises(RuntimeError):
        p.feed("y")


# --- the split property ---------------------------------------------------------------------

JSON_BITS = ["{", "}", "[", "]", '"', "\\", '\\"', ",", ":", " ", "\n", "1", "-2.5e3", "tru", "null", "é世"]
JSON_BITS += ['"name"', '"arguments"', '"parameters"', '": "', '"get_weather"', '"search"', "\\u00e9", "\\u1"]
CALL_BODIES = [
    WEATHER,
    SEARCH,
    '{"arguments": {"q": [1, -2.5e3, true, null, "x\\"y"]}, "name": "search"}',
    '{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}',
    '{"name": "search", "arguments": "{\\"q\\": \\"cats\\"}"}',
    '{"name": "launch_rockets", "arguments": {}}',
    '{"name": "get_weather"}',
    '{"name": 5, "arguments": {}}',
    '{"arguments": {"a": 1}}',
    '{"name": "search", "arguments": {"q": "<tool_call>[TOOL_CALLS]"}}',
    '{"name": "search", "arguments": {"q": 1,, }}',
]
PROSE = ["Let me check.", "Hello", " ", "\n", "<", "[", "see [x](y)"]
MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<tool_call>\n"],
    "llama3_json": ["<|python_tag|>", "<|python", ";", "; ", "\n"],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[AR", "get_weather", "search", "[", "]", ", "],
    "forced_required": ["[", "]", ", ", "\n"],
    "forced_named": ['{"city": "Paris"}', '{"q": ', "[1, 2]"],
}


@st.composite
def structured_text(draw: st.DrawFn, fmt: str) -> str:
    """A well-formed output of the format, maybe cut short."""
    bodies = draw(st.lists(st.sampled_from(CALL_BODIES), min_size=1, max_size=3))
    prose = draw(st.sampled_from(PROSE))
    if fmt == "hermes":
        text = prose + "".join(f"<tool_call>\n{b}\n</tool_call>\n" for b in bodies)
    elif fmt == "llama3_json":
        text = "<|python_tag|>" + "; ".join(bodies) if draw(st.booleans()) else prose + bodies[0]
    elif fmt == "mistral":
        if draw(st.booleans()):
            text = prose + "[TOOL_CALLS][" + ", ".join(bodies) + "]"
        else:
            text = prose + "".join(f"[TOOL_CALLS]{n}[ARGS]{{}}" for n in ("search", "get_weather", "x y"))
    elif fmt == "forced_required":
        text = "[" + ", ".join(bodies) + "]"
    else:
        text = ' {"city": "Paris", "days": [1, 2.5, {"x": null}]} \n'
    return text[: draw(st.integers(0, len(text)))]


def text_for(fmt: str) -> st.SearchStrategy[str]:
    bits = st.sampled_from(JSON_BITS + CALL_BODIES + PROSE + MARKERS[fmt])
    soup = st.lists(bits, max_size=20).map("".join)
    return st.one_of(soup, structured_text(fmt))


def split(text: str, cuts: list[int]) -> list[str]:
    points = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(points)]


def check_split_invariance(fmt: str, text: str, cuts: list[int], **kwargs: Any) -> None:
    reference = parser(fmt, **kwargs)
    reference_outs = run(reference, [text])
    expected = (reference.content, [(c.name, c.arguments) for c in reference.tool_calls])
    assert assemble(reference_outs) == expected
    streamed = parser(fmt, **kwargs)
    assert assemble(run(streamed, split(text, cuts))) == expected
    assert (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == expected
    if fmt in FORCED_FORMATS:
        assert expected[0] == ""


ALL_FORMATS = (*PARSER_FORMATS, *FORCED_FORMATS)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_split_invariance(fmt: str) -> None:
    kwargs: dict[str, Any] = {"forced_name": "get_weather"} if fmt == "forced_named" else {}
    names = st.sampled_from([(), TOOLS]) if fmt in PARSER_FORMATS else st.just(())

    @settings(max_examples=200, deadline=None)
    @given(text_for(fmt), st.lists(st.integers(0, 10_000), max_size=12), names)
    def check(text: str, cuts: list[int], tool_names: tuple[str, ...]) -> None:
        check_split_invariance(fmt, text, cuts, tool_names=tool_names, **kwargs)

    check()
