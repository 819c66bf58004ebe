"""Generate the Helm chart's settings from the config dataclasses, so values, flags and docs agree.

    python -m helm.generate          # rewrite the generated parts of helm/pagedserve/
    python -m helm.generate --check  # exit 1 if they differ from a fresh generation

The one source of every engine setting is `EngineConfig` (dataplane/src/pagedserve/dataplane/config.py); of every
control-plane tuning setting `ControlPlaneConfig` (controlplane/src/pagedserve/controlplane/config.py). Each `setting`
field with a command-line flag becomes, in the chart:

- a value (camelCase key) in `values.yaml`, with its default and help, between the
  `# BEGIN GENERATED <block>` / `# END GENERATED <block>` markers;
- a property of `values.schema.json` (type, choices, the limits the dataclass enforces);
- a line of `templates/_settings.tpl`, which turns the value into the flag on the
  container's command line (a value left null, or removed, leaves the flag out: the
  dataclass default applies);
- a row of the settings tables in the chart's README.md.

Fields the chart sets itself (the model store path, the discovery address, TLS and ports)
are listed in CHART_MANAGED with the reason. The Grafana dashboard
(`files/grafana-dashboard.json`, built by helm/dashboard.py) is written here too, so its
queries live in one place.
Imports no torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python helm/generate.py` from anywhere
    sys.path.insert(0, str(ROOT))

from helm.dashboard import GENERATOR, dashboard  # noqa: E402
from pagedserve.common.settings import (  # noqa: E402
    fields_with_types,
    flag_name,
    is_config,
    parse_bytes,
    scalar_type,
)
from pagedserve.controlplane.config import ControlPlaneConfig  # noqa: E402
from pagedserve.dataplane.config import EngineConfig  # noqa: E402

CHART = ROOT / "helm" / "pagedserve"

# Settings the chart fills in itself, never from `engine` / `controlplane.settings`.
CHART_MANAGED: dict[str, str] = {
    "model_home": "the chart mounts the model store at `models.mountPath` and passes `--model-home`",
    "dataplanes": "the chart passes the data planes' addresses (`pagedserve.controlplane.routing.discovery`)",
    "dataplane_dns": "the chart passes the headless Service's name (`pagedserve.controlplane.routing.discovery`)",
    "dataplane_token_file": "the chart mounts the shared token's Secret (`dataplaneAuth.token`)",
    # ControlPlaneConfig.model: the control planes tokenize with the data planes' model.
    "controlplane.model": "the control planes use `engine.model` (they tokenize for the data planes)",
}

# The limits come from each setting's own bounds (`setting(minimum=...)`, checked by
# `check_bounds` in the dataclass); a size given as text ("2GiB") is checked by its spelling.
BYTES_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([bB]|[kKmMgG]([iI][bB])?)?\s*$"

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Knob:
    """One chart value: a `setting` field of a config dataclass with its flag."""

    section: str  # the dataclass section it sits in ("cache", "routing", ...; "" at the top)
    name: str  # the field name (the dataclass's keyword)
    key: str  # the values key (camelCase)
    flag: str  # the command-line flag
    kind: str  # "bool" | "int" | "float" | "str" | "list"
    item_kind: str | None  # for "list": the items' kind
    optional: bool  # None allowed (then the flag is left out)
    default: Any  # as written in values.yaml (JSON-able; sizes spelled like "2GiB")
    help: str
    choices: tuple[Any, ...] | None
    repeat: bool  # a list given as one flag per item
    bounds: dict[str, Any]  # the setting's JSON-schema bounds (minimum, exclusiveMaximum, ...)
    bytes_text: bool  # a size given as text and parsed by the flag ("2GiB")

    @property
    def schema(self) -> dict[str, Any]:
        if self.kind == "list":
            base: dict[str, Any] = {"type": "array", "items": {"type": _kind_type(self.item_kind)}}
        else:
            base = {"type": _kind_type(self.kind)}
        if self.optional:
            base["type"] = [base["type"], "null"]
        out: dict[str, Any] = {"description": f"{self.help} ({self.flag})", **base}
        if self.choices:
            out["enum"] = [*self.choices, *([None] if self.optional else [])]
        if self.bytes_text:  # its bounds hold for the parsed bytes: the text is checked by spelling
            out["pattern"] = BYTES_PATTERN
        else:
            out.update(self.bounds)
        out["default"] = self.default
        return out


def _kind_type(kind: str | None) -> str:
    return {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}[kind or "str"]


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _kind(tp: Any, parse: Callable[[str], Any] | None) -> tuple[str, str | None]:
    if parse is not None:
        return "str", None  # given as text, parsed by the flag (sizes like "2GiB")
    if typing.get_origin(tp) is tuple:
        (item, *_rest) = typing.get_args(tp)
        return "list", _kind(item, None)[0]
    if tp not in _JSON_TYPES:
        raise TypeError(f"no chart value kind for {tp!r}")
    return {bool: "bool", int: "int", float: "float", str: "str"}[tp], None


def knobs(cls: type, owner: str, section: str = "") -> list[Knob]:
    """Every setting of `cls` that has a flag and is not chart-managed, sections flattened."""
    out: list[Knob] = []
    for f, tp in fields_with_types(cls):
        if is_config(tp):
            out += knobs(tp, owner, f.name)
            continue
        if "help" not in f.metadata or not f.metadata["cli"]:
            continue  # not a setting with a flag (security files, code-only knobs)
        if f.name in CHART_MANAGED or f"{owner}.{f.name}" in CHART_MANAGED:
            continue
        value_type, optional = scalar_type(tp)
        kind, item_kind = _kind(value_type, f.metadata["parse"])
        default = f.default
        if default is not None and f.metadata["show"]:
            default = f.metadata["show"](default)
        if isinstance(default, tuple):
            default = list(default)
        out.append(
            Knob(
                section=section,
                name=f.name,
                key=camel(f.name),
                flag=flag_name(f),
                kind=kind,
                item_kind=item_kind,
                optional=optional,
                default=default,
                help=str(f.metadata["help"]),
                choices=tuple(f.metadata["choices"]) if f.metadata["choices"] else None,
                repeat=bool(f.metadata["repeat"]),
                bounds=dict(f.metadata.get("bounds") or {}),
                bytes_text=f.metadata["parse"] is parse_bytes,
            )
        )
    return out


@dataclass(frozen=True)
class Block:
    """A group of generated values: where they sit in values.yaml and which define renders them."""

    name: str  # the values path, e.g. "engine" or "controlplane.settings"
    source: str  # the dataclass it is generated from, for comments
    define: str  # the template that renders its flags
    knobs: list[Knob]

    @property
    def path(self) -> list[str]:
        return self.name.split(".")


def blocks() -> list[Block]:
    return [
        Block(
            "engine",
            "dataplane/src/pagedserve/dataplane/config.py EngineConfig",
            "pagedserve.engineArgs",
            knobs(EngineConfig, "engine"),
        ),
        Block(
            "controlplane.settings",
            "controlplane/src/pagedserve/controlplane/config.py ControlPlaneConfig",
            "pagedserve.controlplaneSettingsArgs",
            knobs(ControlPlaneConfig, "controlplane"),
        ),
    ]


# -- values.yaml ---------------------------------------------------------------------------------
def yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return json.dumps(value)
    return json.dumps(str(value))  # a JSON string is a YAML string


def values_lines(block: Block) -> list[str]:
    """The block's values, unindented (the caller indents them to the marker's column)."""
    lines = [f"{block.path[-1]}:"]
    section = None
    for knob in block.knobs:
        if knob.section != section:
            section = knob.section
            if section:
                lines.append(f"  # -- {section} --")
        note = f" ({', '.join(map(str, knob.choices))})" if knob.choices else ""
        lines.append(f"  # {knob.flag}: {knob.help}{note}")
        lines.append(f"  {knob.key}: {yaml_scalar(knob.default)}")
    return lines


def replace_regions(text: str, regions: dict[str, list[str]], comment: str = "#") -> str:
    """Replace the lines between `<comment> BEGIN GENERATED name` and `<comment> END GENERATED
    name` with `regions[name]`, indented like the BEGIN marker. Every region must be present."""
    begin = re.compile(rf"^(?P<indent>[ ]*){re.escape(comment)} BEGIN GENERATED (?P<name>[\w.]+)\b.*$")
    out: list[str] = []
    lines = text.splitlines()
    found: set[str] = set()
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        match = begin.match(line)
        i += 1
        if not match or match["name"] not in regions:
            continue
        name, indent = match["name"], match["indent"]
        end = re.compile(rf"^\s*{re.escape(comment)} END GENERATED {re.escape(name)}(\s|$)")
        while i < len(lines) and not end.match(lines[i]):
            i += 1
        if i == len(lines):
            raise ValueError(f"no '{comment} END GENERATED {name}' after '{line.strip()}'")
        out += [(indent + body) if body else "" for body in regions[name]]
        found.add(name)
    missing = sorted(set(regions) - found)
    if missing:
        raise ValueError(f"markers not found for: {', '.join(missing)}")
    return "\n".join(out) + "\n"


# -- values.schema.json --------------------------------------------------------------------------
def block_schema(block: Block) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"Generated from {block.source} by `{GENERATOR}`.",
        "additionalProperties": False,
        "properties": {knob.key: knob.schema for knob in block.knobs},
    }


def schema_text(current: str, all_blocks: list[Block]) -> str:
    schema = json.loads(current)
    for block in all_blocks:
        node = schema
        for part in block.path[:-1]:
            node = node["properties"][part]
        node["properties"][block.path[-1]] = block_schema(block)
    return json.dumps(schema, indent=2) + "\n"


# -- templates/_settings.tpl ---------------------------------------------------------------------
def knob_template(knob: Knob) -> list[str]:
    v = f'index $s "{knob.key}"'
    if knob.kind == "bool":
        no_flag = "--no-" + knob.flag.removeprefix("--")
        emit = [f'- {{{{ ternary "{knob.flag}" "{no_flag}" $v | toJson }}}}']
    elif knob.kind == "list" and knob.repeat:
        emit = ["{{- range $v }}", f'- {{{{ printf "{knob.flag}=%v" . | toJson }}}}', "{{- end }}"]
    elif knob.kind == "list":
        emit = [f"- {json.dumps(knob.flag)}", "{{- range $v }}", "- {{ toString . | toJson }}", "{{- end }}"]
    elif knob.kind == "int":
        emit = [f'- {{{{ printf "{knob.flag}=%d" (int64 $v) | toJson }}}}']
    else:  # str, float: Go's %v prints floats in their shortest form (0.9, 1e-05)
        emit = [f'- {{{{ printf "{knob.flag}=%v" $v | toJson }}}}']
    guard = "if $v" if knob.kind == "list" else 'if not (kindIs "invalid" $v)'
    return [f"{{{{- $v = {v} }}}}", f"{{{{- {guard} }}}}", *emit, "{{- end }}"]


def template_text(all_blocks: list[Block]) -> str:
    lines = [
        f"{{{{/* GENERATED by `{GENERATOR}` from the config dataclasses: do not edit. */}}}}",
        "{{/* Each define renders one block of values as container args, one flag per value;",
        "     a value that is null or absent leaves its flag out (the dataclass default applies). */}}",
    ]
    for block in all_blocks:
        lookup = ".Values"
        for part in block.path:
            lookup = f"(({lookup}).{part} | default dict)"
        lines += [
            "",
            f"{{{{/* {block.name}: {block.source} */}}}}",
            f'{{{{- define "{block.define}" -}}}}',
            f"{{{{- $s := {lookup} -}}}}",
            "{{- $v := 0 -}}",
        ]
        for knob in block.knobs:
            lines += knob_template(knob)
        lines.append("{{- end }}")
    return "\n".join(lines) + "\n"


# -- README tables -------------------------------------------------------------------------------
def table_lines(block: Block) -> list[str]:
    lines = [
        f"Generated from `{block.source}` by `{GENERATOR}`.",
        "",
        "| value | flag | default | meaning |",
        "|---|---|---|---|",
    ]
    for knob in block.knobs:
        default = "null (flag left out)" if knob.default is None else yaml_scalar(knob.default)
        choices = f" One of: {', '.join(f'`{c}`' for c in knob.choices)}." if knob.choices else ""
        lines.append(f"| `{block.name}.{knob.key}` | `{knob.flag}` | `{default}` | {knob.help}.{choices} |")
    return lines


# -- all outputs ---------------------------------------------------------------------------------
def outputs(chart: Path) -> dict[Path, str]:
    """Every generated file's full new text (hand-written parts kept from the current files)."""
    all_blocks = blocks()
    values = chart / "values.yaml"
    schema = chart / "values.schema.json"
    readme = chart / "README.md"
    return {
        values: replace_regions(values.read_text(), {b.name: values_lines(b) for b in all_blocks}),
        schema: schema_text(schema.read_text(), all_blocks),
        chart / "templates" / "_settings.tpl": template_text(all_blocks),
        readme: replace_regions(
            readme.read_text(), {b.name: table_lines(b) for b in all_blocks}, comment="<!--"
        ),
        chart / "files" / "grafana-dashboard.json": json.dumps(dashboard(), indent=2) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on drift")
    parser.add_argument("--chart", type=Path, default=CHART, help="the chart directory")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs(args.chart).items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        stale.append(path)
        if args.check:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=1
            )
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(args.chart)) for p in stale)
        print(f"helm/generate: out of date: {names}; run `{GENERATOR}`", file=sys.stderr)
        return 1
    if not args.check:
        print(f"helm/generate: {len(stale)} file(s) rewritten" if stale else "helm/generate: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
