"""GGUF files served as they are: a model folder whose weights are one `.gguf` file.

The planes read a model as a folder: config.json for the architecture, the tokenizer files
for text, the weights. For a GGUF model the folder holds config.json, generation_config.json
and the tokenizer files made once from the file's metadata (transformers reads GGUF
metadata), beside the `.gguf` itself (`models pull` keeps the registry's file so) or a link
to it (`--model PATH.gguf`: the folder is made under the store's `.gguf/` and reused while
the file is unchanged). The data plane then loads the weights from the file, quantized
tensors kept quantized (pagedserve.dataplane.runner.gguf_loader).

Refused here, before either plane loads anything, each with one message: a file that is not
a readable GGUF (truncated, corrupt), an architecture without a loader, a tensor type
without a kernel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pagedserve.common.models.errors import ModelNotFoundError

# general.architecture values the loader maps (their tensor names: gguf_loader.TENSOR_NAMES).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types the loader serves: float ones as they are, quantized ones by the kernels.
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_CACHE = ".gguf"


class GgufError(ModelNotFoundError):
    """A GGUF file that cannot be served; the message names the file and what is wrong."""


def gguf_weights_file(folder: Path) -> Path | None:
    """The `.gguf` file holding `folder`'s weights, when it has no safetensors; else None."""
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return None
    files = sorted(folder.glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def check_gguf(path: Path) -> str:
    """Read `path`'s header and tensor table; returns its architecture. Raises GgufError for
    an unreadable file, an architecture without a loader or a tensor type without a kernel."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise GgufError(
            f"serving a GGUF file needs the 'gguf' package: pip install 'pagedserve[convert]' ({exc})"
        ) from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # numpy and the reader raise many types for a bad file
        raise GgufError(
            f"{path} is not a readable GGUF file: {str(exc)[:300] or type(exc).__name__}"
        ) from None
    field = reader.fields.get("general.architecture")
    arch = (
        bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        if field is not None and field.data
        else ""
    )
    if arch not in ARCHITECTURES:
        raise GgufError(
            f"{path}: architecture {arch or '(none)'!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in FLOAT_TYPES + QUANTIZED_TYPES:
            raise GgufError(
                f"{path}: tensor {tensor.name!r} is {type_name}; supported types are "
                f"{', '.join(QUANTIZED_TYPES + FLOAT_TYPES)}"
            )
    return arch


def write_model_files(gguf_path: Path, dst: Path) -> None:
    """config.json, generation_config.json and the tokenizer files of `gguf_path` into `dst`."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from pagedserve.common.models.convert import quiet_progress, read_gguf_chat_template

    has_tokenizer = "tokenizer.ggml.model" in GGUFReader(str(gguf_path)).fields
    with quiet_progress():
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # Without one (a weights-only file) only token-id prompts work, as with a folder without one.
        tokenizer = (
            AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            if has_tokenizer
            else None
        )
    # The weights are quantized in the file, but the folder's config describes the model
    # the loader builds (float32 activations); transformers' GGUF quantization config is
    # for its own de-quantizing loader.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.architectures = [ARCHITECTURES[config.model_type]]  # transformers' GGUF config leaves it unset
    config.save_pretrained(str(dst))
    GenerationConfig.from_model_config(config).save_pretrained(str(dst))
    if tokenizer is not None:
        if not getattr(tokenizer, "chat_template", None):
            template = read_gguf_chat_template(gguf_path)
            if template:
                tokenizer.chat_template = template
        tokenizer.save_pretrained(str(dst))


def gguf_model_folder(gguf_path: Path, store: Path) -> Path:
    """The model folder serving `gguf_path` (`--model PATH.gguf`): made once per file
    version under `<store>/.gguf/` (the store's root folder), with a link to the file;
    checked first (check_gguf)."""
    path = gguf_path.expanduser().resolve()
    if not path.is_file():
        raise GgufError(f"{gguf_path}: no such GGUF file")
    stat = path.stat()
    digest = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = store / _CACHE
    folder = root / f"{path.stem}-{digest}"
    if (folder / "config.json").is_file() and gguf_weights_file(folder) is not None:
        return folder
    check_gguf(path)
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        write_model_files(path, staged)
        (staged / path.name).symlink_to(path)
        try:
            os.replace(staged, folder)  # atomic; another process may have made it meanwhile
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return folder
