"""`pagedserve --help` and every subcommand's: each option shows its real default, in words where
it is computed or None. No model, no torch import beyond what building the parser does."""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator

import pytest

from pagedserve.benchmarks.cli import SCRIPTS
from pagedserve.cli import build_parser, main
from pagedserve.common.settings import ArgumentParser, HelpFormatter

# A hand-written "(default: X)" whose X is a bare snake_case name is a variable's name, not a
# default (the `models pull` help once said "(default: model_home)").
_PLACEHOLDER = re.compile(r"\(default: ([a-z]+(?:_[a-z0-9]+)+)\)")
# Spellings of "no value" that say nothing about what the setting then does.
_MEANINGLESS = ("(default: None)", "(default: [])", "(default: ())", "(default: )")


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parsers = list(_walk(build_parser(), ("pagedserve",)))
    # `pagedserve bench fp8-quality ...` hands its arguments to the script's own parser.
    for name, (module, _help) in SCRIPTS.items():
        parsers.append((f"pagedserve bench {name}", importlib.import_module(module).build_parser()))
    return parsers


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)


def _shows_a_default(action: argparse.Action) -> bool:
    """Options that take a value, and optional positionals with a default."""
    if isinstance(action, argparse._SubParsersAction) or _is_switch(action):
        return False
    if action.help == argparse.SUPPRESS or action.default is argparse.SUPPRESS or action.required:
        return False
    if not action.option_strings:
        return action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE) and action.default is not None
    return True


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry in `--help` as argparse prints it, whitespace collapsed."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def _problems(where: str, parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    formatter = parser.formatter_class
    if not (isinstance(formatter, type) and issubclass(formatter, HelpFormatter)):
        name = getattr(formatter, "__name__", repr(formatter))
        problems.append(f"{where}: formatter {name}, not settings.HelpFormatter")
    for action in parser._actions:
        if not _shows_a_default(action):
            continue
        flag = action.option_strings[-1] if action.option_strings else action.dest
        text = _rendered(parser, action)
        if "%(default" in text:
            problems.append(f"{where} {flag}: unexpanded placeholder: {text}")
        if text.count("(default") != 1:
            problems.append(f"{where} {flag}: needs exactly one '(default: ...)': {text}")
        for meaningless in _MEANINGLESS:
            if meaningless in text:
                problems.append(f"{where} {flag}: {meaningless} does not say what happens: {text}")
        match = _PLACEHOLDER.search(text)
        if match and match.group(1) != str(action.default) and match.group(1) not in (action.choices or ()):
            problems.append(f"{where} {flag}: '{match.group(1)}' is a name, not a default: {text}")
    return problems


def test_every_option_of_every_subcommand_shows_its_default() -> None:
    problems = [p for where, parser in _all_parsers() for p in _problems(where, parser)]
    assert not problems, "\n".join(problems)


def test_every_subcommand_is_walked_and_renders() -> None:
    parsers = dict(_all_parsers())
    for expected in (
        "pagedserve models pull",
        "pagedserve models list",
        "pagedserve serve",
        "pagedserve client generate",
        "pagedserve doctor",
        "pagedserve bench serve",
        "pagedserve bench fp8-quality",
    ):
        assert expected in parsers
    for parser in parsers.values():
        assert parser.format_help()


def test_the_checker_catches_placeholders_and_unexplained_nones() -> None:
    bad = ArgumentParser(prog="bad")
    bad.add_argument("--model-home", default=None, help="store directory (default: model_home)")
    bad.add_argument("--limit", type=int, default=None, help="first N only")
    bad.add_argument("--stop", action="append", default=[], help="stop string")
    bad.add_argument("--kv-memory", type=float, default=2.0, help="GiB (default 2)")
    bad.add_argument("--raw", default="x", help="shows %%(default)s")
    bad.add_argument("--bare", type=int, default=3)  # no help: the formatter still shows the default
    bad.add_argument("--force", action="store_true", help="a switch: no default to show")
    found = "\n".join(_problems("bad", bad))
    for flag in ("--model-home", "--limit", "--stop", "--kv-memory", "--raw"):
        assert f"bad {flag}:" in found
    assert "--bare" not in found and "--force" not in found
    assert "(default: 3)" in _rendered(bad, bad._actions[-2])


def test_plain_argparse_subparsers_would_be_caught() -> None:
    root = argparse.ArgumentParser(prog="root", formatter_class=HelpFormatter)
    leaf = root.add_subparsers().add_parser("leaf")  # argparse does not pass formatter_class down
    assert [p for where, parser in _walk(root, ("root",)) for p in _problems(where, parser)] == [
        "root leaf: formatter HelpFormatter, not settings.HelpFormatter"
    ]
    assert leaf.formatter_class is argparse.HelpFormatter


def test_switches_do_not_claim_a_default() -> None:
    # "(default: False)" on --no-prefix-caching would read as "prefix caching is off".
    throughput = dict(_walk(build_parser(), ("pagedserve",)))["pagedserve bench throughput"]
    switch = next(a for a in throughput._actions if "--no-prefix-caching" in a.option_strings)
    assert "(default: False)" not in _rendered(throughput, switch)


def test_client_generate_help_lists_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["client", "generate", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL" in text
    assert "(default: the served model)" in text
    assert "--max-tokens MAX_TOKENS most tokens to generate (default: 128)" in text
    assert "--address ADDRESS the control plane's gRPC HOST:PORT (default: 127.0.0.1:50051)" in text


def test_api_key_default_is_described_not_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-secret-in-env")
    with pytest.raises(SystemExit):
        main(["client", "generate", "--help"])
    out = capsys.readouterr().out
    assert "sk-secret-in-env" not in out
    assert "$PAGEDSERVE_API_KEY" in out


def test_models_pull_help_says_where_the_store_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["models", "pull", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model_home" not in text
    assert (
        "(default: $PAGEDSERVE_MODEL_HOME, else $XDG_CACHE_HOME/pagedserve/models, else ~/.cache/pagedserve/models)"
        in text
    )
    assert "(default: SmolLM2-135M-Instruct)" in text
