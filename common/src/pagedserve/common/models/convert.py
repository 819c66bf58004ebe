"""GGUF -> Hugging Face safetensors conversion.

transformers dequantizes a GGUF checkpoint to fp32 on load (`gguf_file=`), but the loaded
model still carries a `quantization_config` and `save_pretrained` refuses it. So: load the
GGUF, build a fresh model from the same config without the quantization config, copy the
state dict over and save that. transformers/torch/gguf are imported lazily, inside the
functions, so importing `pagedserve.common.models` stays cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Stage callback: called with a short stage name as each stage starts.
StageCallback = Callable[[str], None]

CONVERT_STAGES = ("load gguf", "rebuild", "save")


class ConversionError(RuntimeError):
    """The GGUF file could not be converted into a Hugging Face folder."""


def _noop(_stage: str) -> None:
    return None


def read_gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in a GGUF file's metadata, if any."""
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - gguf is needed to load the GGUF at all
        return None
    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    raw = field.parts[field.data[0]]
    return bytes(raw).decode("utf-8")


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No progress bars from transformers and huggingface_hub inside the block (transformers'
    "Loading weights", "Writing model shards", its GGUF loader's "Converting and de-quantizing
    GGUF tensors", hub downloads), and transformers' own logging at ERROR only: errors still
    log, exceptions still raise. Everything is as before afterwards."""
    from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hub_bars_were_off = are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    gguf_utils: Any = None
    gguf_tqdm: Any = None
    try:
        # This loader calls tqdm.auto.tqdm itself, past transformers' progress-bar switch.
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    except (ImportError, AttributeError):  # another transformers layout: its bar may show
        gguf_utils = None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
        if hub_bars_were_off:
            disable_progress_bars()
        if gguf_utils is not None:
            gguf_utils.tqdm = gguf_tqdm


def convert_gguf(
    gguf_path: Path, dst: Path, on_stage: StageCallback | None = None, progress: bool = True
) -> None:
    """Convert the GGUF checkpoint at `gguf_path` into a Hugging Face folder at `dst` (fp32 safetensors).

    `dst` is created if needed. Writes config.json, generation_config.json, model.safetensors
    and the tokenizer files (with the chat template, taken from the GGUF metadata if
    transformers did not carry it over). `progress` False: no progress bars from the libraries
    doing the work (`quiet_progress`).
    """
    if progress:
        _convert(gguf_path, dst, on_stage or _noop)
        return
    with quiet_progress():
        _convert(gguf_path, dst, on_stage or _noop)


def _convert(gguf_path: Path, dst: Path, stage: StageCallback) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConversionError(
            f"GGUF conversion needs transformers, torch, gguf and accelerate ({exc}); "
            "install them with: pip install 'pagedserve[convert]'"
        ) from exc

    src_dir = str(gguf_path.parent)
    gguf_file = gguf_path.name

    stage("load gguf")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    except ImportError as exc:
        raise ConversionError(
            f"loading GGUF needs the 'gguf' and 'accelerate' packages ({exc}); "
            "install them with: pip install 'pagedserve[convert]'"
        ) from exc

    stage("rebuild")
    config = loaded.config
    # The weights are already fp32; the GGUF quantization config only makes save_pretrained refuse.
    if hasattr(config, "quantization_config"):
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None
    config.dtype = torch.float32
    state_dict: dict[str, Any] = loaded.state_dict()
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state_dict, strict=False)
    # Tied weights (lm_head <-> embed_tokens) may legitimately be absent from one side.
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    real_missing = [k for k in missing if k not in tied and not k.startswith("lm_head")]
    if real_missing or unexpected:
        raise ConversionError(f"state dict mismatch: missing={real_missing[:5]} unexpected={unexpected[:5]}")
    fresh.eval()
    del loaded, state_dict

    if not getattr(tokenizer, "chat_template", None):
        template = read_gguf_chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template

    generation_config = fresh.generation_config
    if generation_config is None:
        generation_config = GenerationConfig.from_model_config(config)

    stage("save")
    dst.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(dst), safe_serialization=True)
    generation_config.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
