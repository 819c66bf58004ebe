"""One source per setting: a config dataclass field carries its name, type, default and help once.

`setting(...)` declares a field; everything else is derived from the dataclass:

- `add_arguments(group, cls)`: the command-line flags (`--block-size`, defaults shown in `--help`);
- `from_arguments(cls, args)`: the dataclass from parsed flags;
- `to_json(config)` / `from_json(cls, text)`: the config handed to a child process.

Nested config dataclasses (a field whose type is itself a config dataclass) are sections:
their flags are added in their own argument group and their fields filled from the same flat
namespace, so every setting name must be unique across the sections of one config.
Imports no torch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, unless its help already says what the default means.

    A flag whose default is computed or None says so in words in its help, e.g.
    "(default: $PAGEDSERVE_MODEL_HOME, else ~/.cache/pagedserve/models)"; tests/test_cli_help.py
    holds every `pagedserve` subcommand to that.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default:" in action.help:
            return action.help
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            # A switch (store_true, store_const, ...) is off unless given: "(default: False)" on
            # `--no-prefix-caching` would only read as the opposite of what it means.
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        # argparse prints no help line at all, so no default, for a flag without help text.
        if (
            not action.help
            and action.option_strings
            and action.nargs != 0
            and action.default is not argparse.SUPPRESS
        ):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose help is formatted by `HelpFormatter`.

    `add_subparsers` builds subparsers of the parser's own class, so every subcommand below a
    parser of this class gets the same formatter without passing `formatter_class` itself.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(value: int) -> str:
    """The shortest exact spelling parse_bytes reads back: 2147483648 -> '2GiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value % size == 0 and value >= size:
            return f"{value // size}{unit}"
    return str(value)


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[Any, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    repeat: bool = False,
    cli: bool = True,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: float | None = None,
    exclusive_maximum: float | None = None,
    min_length: int | None = None,
) -> Any:
    """A config field with its command-line face.

    `flag` overrides the derived `--field-name`; `parse` turns the flag's text into the value
    (its type otherwise); `show` spells the default in `--help`. A `tuple[X, ...]` field takes
    several values after one flag, or with `repeat` one per repeated flag. `cli` False keeps
    the field out of the command line (set by code only).
    """
    bounds = {
        key: value
        for key, value in (
            ("minimum", minimum),
            ("maximum", maximum),
            ("exclusiveMinimum", exclusive_minimum),
            ("exclusiveMaximum", exclusive_maximum),
            ("minLength", min_length),
        )
        if value is not None
    }
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "parse": parse,
        "show": show,
        "repeat": repeat,
        "cli": cli,
        "bounds": bounds,  # JSON Schema's names: the chart's schema takes them as they are
    }
    return dataclasses.field(default=default, metadata=metadata)


def bounds_rule(bounds: dict[str, float]) -> str:
    """A setting's bounds as a rule a person reads: ">= 1", "> 0", "in (0, 1]", "in [0, 1)",
    "a string of at least 1 character"."""
    if "minLength" in bounds:
        n = int(bounds["minLength"])
        return f"a string of at least {n} character{'s' if n != 1 else ''}"
    low = ("[", bounds["minimum"]) if "minimum" in bounds else ("(", bounds.get("exclusiveMinimum"))
    high = ("]", bounds["maximum"]) if "maximum" in bounds else (")", bounds.get("exclusiveMaximum"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high[1] is not None:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return ""


def check_bounds(config: Any) -> None:
    """The one check of every bounded setting of a config dataclass (its own fields; sections
    check theirs): a value outside its bounds, or not a number, raises ValueError
    "<name> must be <rule>, got <value>"."""
    for f in dataclasses.fields(config):
        bounds = f.metadata.get("bounds") if f.metadata else None
        value = getattr(config, f.name)
        if not bounds or value is None:
            continue
        if "minLength" in bounds:
            if not isinstance(value, str) or len(value) < bounds["minLength"]:
                raise ValueError(f"{f.name} must be {bounds_rule(bounds)}, got {value!r}")
            continue
        whole = "int" in str(f.type) and "float" not in str(f.type)  # an int setting takes no 1.5
        number = (
            isinstance(value, int if whole else int | float)
            and not isinstance(value, bool)
            and value == value
        )
        ok = number and (
            value >= bounds.get("minimum", value)
            and value <= bounds.get("maximum", value)
            and ("exclusiveMinimum" not in bounds or value > bounds["exclusiveMinimum"])
            and ("exclusiveMaximum" not in bounds or value < bounds["exclusiveMaximum"])
            and value not in (float("inf"), float("-inf"))
        )
        if not ok:
            what = "an integer " if whole else ""
            raise ValueError(f"{f.name} must be {what}{bounds_rule(bounds)}, got {value!r}")


def is_config(tp: Any) -> bool:
    """Whether an annotation is a config section (a nested config dataclass)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def fields_with_types(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def scalar_type(tp: Any) -> tuple[Any, bool]:
    """(the flag's value type, whether None is allowed) of an annotation like `int | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    title: str | None = None,
    skip: set[str] | frozenset[str] = frozenset(),
    only: set[str] | frozenset[str] | None = None,
) -> None:
    """Add a flag for every `setting` of `cls` (sections in their own groups) to `parser` (or an
    argument group); `skip` names settings another group of the same parser already has, and
    `only`, when given, the settings to add (a tool that takes a few engine flags declares them
    from the one source, with the engine's help, choices and default)."""
    group = parser.add_argument_group(title) if title else parser
    for f, tp in fields_with_types(cls):
        if is_config(tp):
            add_arguments(
                parser if only is None else group,
                tp,
                title=f.name if only is None else None,
                skip=skip,
                only=only,
            )
            continue
        if "help" not in f.metadata or not f.metadata["cli"] or f.name in skip:
            continue
        if only is not None and f.name not in only:
            continue
        value_type, _ = scalar_type(tp)
        default = f.default
        if f.metadata["show"] and default is not None:
            # argparse runs a string default through `type`: --help shows "2GiB", args get bytes.
            default = f.metadata["show"](default)
        # Parsers use argparse.ArgumentDefaultsHelpFormatter: --help shows every default.
        flag = flag_name(f)
        help_text = f.metadata["help"]
        if f.metadata.get("bounds"):
            help_text = f"{help_text} [{bounds_rule(f.metadata['bounds'])}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if value_type is not bool and not f.metadata["choices"]:
            kwargs["metavar"] = flag.removeprefix("--").replace("-", "_").upper()
        if value_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(value_type) is tuple:
            # argparse appends to its default in place: start from None, from_arguments keeps ().
            kwargs["default"] = None
            kwargs["type"] = f.metadata["parse"] or typing.get_args(value_type)[0]
            if f.metadata["repeat"]:
                kwargs["action"] = "append"
            else:
                kwargs["nargs"] = "+"
        else:
            kwargs["type"] = f.metadata["parse"] or value_type
            if f.metadata["choices"]:
                kwargs["choices"] = list(f.metadata["choices"])
        group.add_argument(flag, **kwargs)


def from_arguments(cls: type[T], args: argparse.Namespace | dict[str, Any]) -> T:
    """`cls` from parsed flags (or a flat dict); names absent from it keep their defaults."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    kwargs: dict[str, Any] = {}
    for f, tp in fields_with_types(cls):
        if is_config(tp):
            kwargs[f.name] = from_arguments(tp, values)
        elif f.name in values:
            value = values[f.name]
            if typing.get_origin(scalar_type(tp)[0]) is tuple:
                if value is None:
                    continue  # flag not given: the field's default
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def setting_names(cls: type) -> list[str]:
    """Every leaf setting's name, sections flattened (the keyword arguments `from_arguments` reads)."""
    names: list[str] = []
    for f, tp in fields_with_types(cls):
        names += setting_names(tp) if is_config(tp) else [f.name]
    return names


def from_kwargs(cls: type[T], kwargs: dict[str, Any]) -> T:
    """`cls` from flat keyword arguments; an unknown name is a TypeError, as for any call."""
    known = set(setting_names(cls))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unexpected setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return from_arguments(cls, kwargs)


def to_json(config: Any) -> str:
    """A config dataclass as JSON (its sections nested), for a child process's `from_json`."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def from_json(cls: type[T], text: str) -> T:
    """Inverse of `to_json`; unknown keys are an error (parent and child must be one version)."""
    return _from_dict(cls, json.loads(text))


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    kwargs: dict[str, Any] = {}
    for f, tp in fields_with_types(cls):
        if f.name in data:
            value = data[f.name]
            if is_config(tp):
                value = _from_dict(tp, value)
            elif typing.get_origin(scalar_type(tp)[0]) is tuple and value is not None:
                value = tuple(value)  # JSON has lists only
            kwargs[f.name] = value
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting(s): {', '.join(sorted(unknown))}")
    return cls(**kwargs)
