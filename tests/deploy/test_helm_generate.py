"""helm/generate.py: the chart's engine and control-plane values, their schema, the flags
template and the docs tables are generated from the config dataclasses; `--check` fails on
drift, and the schema's limits are the dataclasses' own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from helm import generate
from helm.generate import BYTES_PATTERN, Knob, blocks, knobs
from pagedserve.cli import build_parser
from pagedserve.common import settings
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.dataplane.config import EngineConfig
from tests.deploy.chart import CHART


def test_generated_chart_files_are_up_to_date() -> None:
    assert generate.main(["--check"]) == 0, "run `python -m helm.generate`"


def test_check_reports_drift_and_a_run_repairs_it_keeping_hand_edits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chart = tmp_path / "pagedserve"
    shutil.copytree(CHART, chart)
    values = chart / "values.yaml"
    text = values.read_text()
    assert "  blockSize: 16\n" in text
    values.write_text(
        text.replace("  blockSize: 16\n", "  blockSize: 8\n").replace("replicas: 2", "replicas: 5")
    )
    (chart / "templates" / "_settings.tpl").unlink()
    assert generate.main(["--check", "--chart", str(chart)]) == 1
    err = capsys.readouterr().err
    assert "values.yaml" in err and "_settings.tpl" in err
    assert generate.main(["--chart", str(chart)]) == 0
    assert generate.main(["--check", "--chart", str(chart)]) == 0
    repaired = values.read_text()
    assert "  blockSize: 16\n" in repaired and "replicas: 5" in repaired  # hand-written parts stay


def test_missing_markers_are_an_error(tmp_path: Path) -> None:
    chart = tmp_path / "pagedserve"
    shutil.copytree(CHART, chart)
    readme = chart / "README.md"
    readme.write_text(readme.read_text().replace("<!-- END GENERATED engine -->", ""))
    with pytest.raises(ValueError, match="END GENERATED engine"):
        generate.main(["--chart", str(chart)])


def subcommand_actions(command: str) -> dict[str, Any]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    sub_parser = sub.choices[command]  # type: ignore[index]
    return {opt: action for action in sub_parser._actions for opt in action.option_strings}


@pytest.mark.parametrize(("block", "command"), [(0, "dataplane"), (1, "controlplane")])
def test_every_knob_is_a_flag_of_the_real_parser_with_the_same_default(block: int, command: str) -> None:
    actions = subcommand_actions(command)
    for knob in blocks()[block].knobs:
        action = actions[knob.flag]
        assert action.dest == knob.name
        default = action.default
        assert default == knob.default or (knob.kind == "list" and default is None and knob.default == []), (
            knob
        )
        if knob.choices:
            assert list(action.choices) == list(knob.choices)
        if knob.kind == "bool":
            assert f"--no-{knob.flag[2:]}" in action.option_strings


def test_values_yaml_defaults_are_the_dataclass_defaults() -> None:
    yaml = pytest.importorskip("yaml")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    engine, cp = blocks()
    assert values["engine"] == {k.key: k.default for k in engine.knobs}
    assert values["controlplane"]["settings"] == {k.key: k.default for k in cp.knobs}
    # The sizes are spelled as the flag reads them, and mean the dataclass's bytes.
    assert settings.parse_bytes(values["engine"]["kvCacheMemory"]) == EngineConfig().cache.kv_cache_memory


def test_schema_describes_every_knob_and_nothing_else() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    engine, cp = blocks()
    for block, node in (
        (engine, schema["properties"]["engine"]),
        (cp, schema["properties"]["controlplane"]["properties"]["settings"]),
    ):
        assert node["additionalProperties"] is False
        assert set(node["properties"]) == {k.key for k in block.knobs}
        for knob in block.knobs:
            assert node["properties"][knob.key]["description"].endswith(f"({knob.flag})")


def build(knob: Knob, value: Any) -> None:
    """Construct the knob's dataclass with `value` (its __post_init__ checks run)."""
    if knob.name == "kv_cache_memory":
        value = settings.parse_bytes(value)
    if knob.name in settings.setting_names(EngineConfig):
        settings.from_kwargs(EngineConfig, {knob.name: value})
    else:
        settings.from_kwargs(ControlPlaneConfig, {"dataplanes": ("dp:50052",), knob.name: value})


BOUNDED = {k.name: k for b in blocks() for k in b.knobs if k.bounds or k.bytes_text}


def test_the_settings_that_were_bounded_by_hand_still_are() -> None:
    assert {
        "block_size",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_queue_len",
        "queue_timeout_s",
    } <= set(BOUNDED)
    # (once missing from the chart: a value the pod would refuse passed `helm install`)
    assert {"watermark", "swap_space", "num_cpu_blocks_override", "tensor_parallel_size"} <= set(BOUNDED)


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_schema_limits_are_the_dataclasses_limits(name: str) -> None:
    knob = BOUNDED[name]
    limits = knob.schema
    step = 1 if knob.kind == "int" else 0.01
    inside: list[Any] = []
    outside: list[Any] = []
    if "minimum" in limits:
        inside.append(limits["minimum"])
        outside.append(limits["minimum"] - step)
    if "exclusiveMinimum" in limits:
        inside.append(limits["exclusiveMinimum"] + step)
        outside.append(limits["exclusiveMinimum"])
    if "maximum" in limits:
        inside.append(limits["maximum"])
        outside.append(limits["maximum"] + step)
    if "exclusiveMaximum" in limits:
        inside.append(limits["exclusiveMaximum"] - step)
        outside.append(limits["exclusiveMaximum"])
    if "minLength" in limits:
        inside.append("x")
        outside.append("")
    if "pattern" in limits:
        inside.append("512MiB")
    for value in inside:
        build(knob, value)
    for value in outside:
        with pytest.raises(ValueError):
            build(knob, value)


def test_one_declaration_gives_the_check_the_help_and_the_chart_schema() -> None:
    @dataclasses.dataclass(frozen=True)
    class Toy:
        replicas: int = settings.setting(2, "copies to run", minimum=2, maximum=8)
        ratio: float = settings.setting(0.5, "a share", exclusive_minimum=0, exclusive_maximum=1)

        def __post_init__(self) -> None:
            settings.check_bounds(self)

    with pytest.raises(ValueError, match=r"^replicas must be an integer in \[2, 8\], got 1$"):
        Toy(replicas=1)
    with pytest.raises(ValueError, match=r"^replicas must be an integer in \[2, 8\], got 2\.5$"):
        Toy(replicas=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^ratio must be in \(0, 1\), got 1$"):
        Toy(ratio=1)
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    settings.add_arguments(parser, Toy)
    assert "copies to run [in [2, 8]]" in " ".join(parser.format_help().split())
    (replicas, ratio) = knobs(Toy, "toy")
    assert (replicas.schema["minimum"], replicas.schema["maximum"]) == (2, 8)
    assert (ratio.schema["exclusiveMinimum"], ratio.schema["exclusiveMaximum"]) == (0, 1)


@pytest.mark.parametrize(
    "text",
    ["2GiB", "512MiB", "1073741824", "1.5g", "64k", " 3 mib ", "7b", "2 gigs", "GiB", "-1GiB", "1TiB", ""],
)
def test_size_pattern_accepts_what_the_flag_parses(text: str) -> None:
    try:
        settings.parse_bytes(text)
        parses = True
    except Exception:
        parses = False
    assert bool(re.search(BYTES_PATTERN, text)) == parses
