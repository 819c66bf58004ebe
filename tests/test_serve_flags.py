"""`pagedserve serve` takes every data-plane setting it can pass on to its child, and each one
given reaches the child's DataPlaneConfig: the README's tuning table walked flag by flag, then
every DataPlaneConfig setting but the child's endpoint (which `serve` sets itself)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import build_parser
from pagedserve.common.settings import fields_with_types, flag_name, is_config, parse_bytes
from pagedserve.dataplane.config import ENDPOINT_SETTINGS, DataPlaneConfig
from pagedserve.serve import dataplane_config

README = Path(__file__).resolve().parents[1] / "README.md"
# Flags valid only next to another setting (the configs check them together).
COMPANIONS = {"--kv-scales-path": ["--kv-cache-dtype", "fp8_e4m3"]}


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def tuning_flags() -> list[str]:
    section = README.read_text().split("\n## Tuning\n", 1)[1].split("\n## ", 1)[0]
    flags = re.findall(r"^\| `(--[a-z0-9-]+)`", section, re.M)
    assert "--omp-spin-count" in flags and len(flags) >= 10, flags
    return flags


def settings_by_flag(cls: type = DataPlaneConfig, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Flag -> (the path of sections to it in a DataPlaneConfig, its field)."""
    found: dict[str, Any] = {}
    for f, tp in fields_with_types(cls):
        if is_config(tp):
            found |= settings_by_flag(tp, (*path, f.name))
        elif f.metadata.get("cli") and f.name not in ENDPOINT_SETTINGS:
            found[flag_name(f)] = ((*path, f.name), f)
    return found


def another_value(flag: str, action: argparse.Action, field: dataclasses.Field[Any]) -> tuple[list[str], Any]:
    """Arguments that set `flag` to something other than its default, and the value they mean."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return ([f"--no-{flag[2:]}"] if field.default else [flag]), not field.default
    if action.choices:
        choice = next(c for c in action.choices if c != field.default)
        return [flag, str(choice)], choice
    if field.metadata["parse"] is parse_bytes:
        return [flag, "1GiB"], 2**30
    if flag == "--speculative-config":  # JSON text, checked by its config
        return [flag, '{"method": "suffix"}'], '{"method": "suffix"}'
    bounds = field.metadata["bounds"]
    value = (field.default if isinstance(field.default, int | float) else 0) * 2 or 1
    value = min(value, bounds.get("maximum", value))
    assert callable(action.type)
    return [flag, str(value)], action.type(str(value))


def configured(argv: list[str]) -> DataPlaneConfig:
    args = serve_parser().parse_args(argv)
    return dataplane_config(argparse.Namespace(**{**vars(args), "dataplane_token_file": None}))


def value_at(config: DataPlaneConfig, path: tuple[str, ...]) -> Any:
    node: Any = config
    for name in path:
        node = getattr(node, name)
    return node


def check_reaches_the_child(flag: str) -> None:
    known = settings_by_flag()
    assert flag in known, f"{flag} is not a DataPlaneConfig setting `serve` passes on"
    path, field = known[flag]
    action = serve_parser()._option_string_actions.get(flag)
    assert action is not None, f"`pagedserve serve` does not accept {flag}"
    argv, expected = another_value(flag, action, field)
    companions = COMPANIONS.get(flag, [])
    assert value_at(configured(companions), path) != expected  # (so the flag is what changed it)
    assert value_at(configured([*companions, *argv]), path) == expected, argv


@pytest.mark.parametrize("flag", tuning_flags())
def test_each_flag_of_the_readme_tuning_table_is_a_serve_flag_that_reaches_the_data_plane(flag: str) -> None:
    assert flag in serve_parser().format_help()
    check_reaches_the_child(flag)


def test_every_data_plane_setting_but_the_endpoint_is_passed_on_by_serve() -> None:
    flags = sorted(settings_by_flag())
    assert {"--omp-spin-count", "--metrics-port", "--dataplane-id", "--block-size"} <= set(flags)
    for flag in flags:
        check_reaches_the_child(flag)


def test_the_childs_endpoint_is_serves_own() -> None:
    args = serve_parser().parse_args(
        ["--host", "0.0.0.0", "--tls-cert-file", "public.pem", "--dataplane-port", "5"]
    )
    config = dataplane_config(argparse.Namespace(**{**vars(args), "dataplane_token_file": "link.token"}))
    assert (config.host, config.port, config.dataplane_token_file) == ("127.0.0.1", 5, "link.token")
    assert config.tls_cert_file is None  # the public ports' certificate is not the child's
