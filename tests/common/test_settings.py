"""One source per setting: the config dataclasses drive the flags, `LLM(...)` and the child's config."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagedserve.cli import build_parser
from pagedserve.common import settings
from pagedserve.common.settings import format_bytes, parse_bytes, setting
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.dataplane.config import CacheConfig, DataPlaneConfig, EngineConfig, engine_config
from pagedserve.serve import child_command, dataplane_config

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Inner:
    size: int = setting(4096, "bytes", parse=parse_bytes, show=format_bytes)
    names: tuple[str, ...] = setting((), "names", flag="--name", repeat=True)


@dataclass(frozen=True)
class _Outer:
    count: int | None = setting(None, "a count")
    on: bool = setting(True, "a switch")
    hidden: float = setting(0.5, "set by code", cli=False)
    inner: _Inner = field(default_factory=_Inner)


def _parse(argv: list[str]) -> _Outer:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, _Outer)
    return settings.from_arguments(_Outer, parser.parse_args(argv))


def test_flags_are_derived_with_types_defaults_and_sections() -> None:
    assert _parse([]) == _Outer()
    got = _parse(["--count", "3", "--no-on", "--size", "1MiB", "--name", "a", "--name", "b"])
    assert got == _Outer(count=3, on=False, inner=_Inner(size=2**20, names=("a", "b")))
    with pytest.raises(SystemExit):
        _parse(["--hidden", "1.0"])  # cli=False: no flag


def test_kwargs_and_json_round_trip() -> None:
    config = settings.from_kwargs(_Outer, {"count": 2, "size": 8})
    assert config == _Outer(count=2, inner=_Inner(size=8))
    assert settings.from_json(_Outer, settings.to_json(config)) == config
    with pytest.raises(TypeError, match="unexpected setting"):
        settings.from_kwargs(_Outer, {"colour": "red"})
    with pytest.raises(ValueError, match="unknown _Outer setting"):
        settings.from_json(_Outer, '{"colour": "red"}')


def test_bytes_spelling() -> None:
    assert [format_bytes(v) for v in (2 * 2**30, 512 * 2**20, 3 * 2**10, 1000)] == [
        "2GiB",
        "512MiB",
        "3KiB",
        "1000",
    ]
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1073741824") == 2**30


def test_setting_names_are_unique_across_sections() -> None:
    # A flat namespace (flags, LLM kwargs) needs every name once.
    for cls in (EngineConfig, DataPlaneConfig, ControlPlaneConfig):
        names = settings.setting_names(cls)
        assert len(names) == len(set(names)), cls


def test_serve_hands_its_child_the_engine_config_it_was_given() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--block-size",
            "8",
            "--kv-cache-memory",
            "64MiB",
            "--no-enable-prefix-caching",
            "--threads",
            "1",
        ]
    )
    config = dataplane_config(args)
    assert config.engine.cache == CacheConfig(
        block_size=8, kv_cache_memory=64 * 2**20, enable_prefix_caching=False
    )
    assert config.engine.model.num_threads == 1
    command = child_command(config)
    assert command[1:5] == ["-m", "pagedserve", "dataplane", "--config-json"]
    child_args = build_parser().parse_args(command[3:])
    from pagedserve.dataplane.cli import dataplane_config_from_args

    assert dataplane_config_from_args(child_args) == config


def test_llm_settings_are_engine_config_fields() -> None:
    assert engine_config(block_size=4, max_num_seqs=3) == EngineConfig(
        cache=CacheConfig(block_size=4), scheduler=EngineConfig().scheduler.__class__(max_num_seqs=3)
    )


def test_help_shows_defaults() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
    text = " ".join(serve.format_help().split())
    assert "--kv-cache-memory KV_CACHE_MEMORY" in text
    assert "(default: 2GiB)" in text
    assert "--max-num-seqs MAX_NUM_SEQS" in text
    assert "most sequences in one batch [>= 1] (default: 64)" in text
    assert "(default: the model's limit) (default" not in text


_DUMMY_PROBE = """
import sys, json
from pagedserve.cli import build_parser
from pagedserve.serve import child_command, dataplane_config
from pagedserve.dataplane.cli import dataplane_config_from_args
from pagedserve.dataplane import LLM

args = build_parser().parse_args(["serve", "--dummy-knob", "9"])
child = dataplane_config_from_args(build_parser().parse_args(child_command(dataplane_config(args))[3:]))
llm = LLM(sys.argv[1], dummy_knob=5, num_gpu_blocks_override=16, max_model_len=64)
print(json.dumps({"child": child.engine.scheduler.dummy_knob, "llm": llm.engine.config.scheduler.dummy_knob}))
"""


def test_one_edit_adds_a_setting_everywhere(tmp_path: Path) -> None:
    """Add one field to SchedulerConfig in a copy of the source: it shows up in `serve --help`
    with its default, in `LLM(...)` and in the data-plane child's config."""
    from pagedserve.benchmarks.tiny_models import make_tiny_model

    copy = tmp_path / "src"
    dists: tuple[str, ...] = ("src", "protos/src", "common/src", "clients/python/src", "kernels/src")
    dists += ("controlplane/src", "dataplane/src", "benchmarks/src")
    for dist in dists:
        shutil.copytree(REPO / dist, copy / dist, ignore=shutil.ignore_patterns("__pycache__"))
    config_py = copy / "dataplane/src/pagedserve/dataplane/config.py"
    anchor = '    max_num_seqs: int = setting(64, "most sequences in one batch", minimum=1)\n'
    text = config_py.read_text()
    assert anchor in text
    config_py.write_text(
        text.replace(anchor, anchor + '    dummy_knob: int = setting(7, "a knob for this test", minimum=1)\n')
    )

    env = {"PYTHONPATH": os.pathsep.join(str(copy / dist) for dist in dists), "PATH": "/usr/bin:/bin"}
    help_text = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", "--help"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "--dummy-knob DUMMY_KNOB" in help_text
    assert "a knob for this test [>= 1] (default: 7)" in " ".join(help_text.split())

    tiny = make_tiny_model("llama", tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, "-c", _DUMMY_PROBE, str(tiny)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == '{"child": 9, "llm": 5}'
