"""Loads a local checkpoint (config + safetensors, or GGUF) into the model the engine runs
(pagedserve.dataplane.models: the owned forward of its architecture, or transformers')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedserve.common.log import get_logger
from pagedserve.common.models.gguf_folder import gguf_weights_file
from pagedserve.dataplane.models import CausalLM, build_causal_lm
from pagedserve.dataplane.models.safetensors_loader import load_owned_safetensors
from pagedserve.dataplane.models.transformers_backend import register_paged_attention
from pagedserve.dataplane.runner.quant_linear import quantize_linears

log = get_logger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def quantized_by(path: Path, quantization: str | None) -> str | None:
    """What makes the model in `path` quantized, for messages: "a GGUF model (FILE)",
    "quantization int8", or None. A GGUF model with `quantization` as well is refused."""
    gguf = gguf_weights_file(path)
    if gguf is not None and quantization:
        raise ValueError(
            f"quantization {quantization}: {path} is a GGUF model, quantized already (its weights "
            "are served as its file has them)"
        )
    if gguf is not None:
        return f"a GGUF model ({gguf.name})"
    return f"quantization {quantization}" if quantization else None


def load_model(
    path: Path, dtype: str, device: str, quantization: str | None = None, model_impl: str = "auto"
) -> CausalLM:
    """Load the causal LM in `path` (never from a hub) as the model `model_impl` picks
    (pagedserve.dataplane.models.build_causal_lm). A GGUF folder's weights stay quantized
    (gguf_loader.py), and `quantization` ("int8") quantizes a float checkpoint's linears at
    load: both on the CPU with float32 activations."""
    from transformers import AutoModelForCausalLM

    attn = register_paged_attention()
    what = quantized_by(path, quantization)
    if what is not None and (dtype != "float32" or torch.device(device).type != "cpu"):
        raise ValueError(
            f"{what} runs on the CPU with float32 activations: --dtype float32 --device cpu, "
            f"not --dtype {dtype} --device {device}"
        )
    gguf = gguf_weights_file(path)
    if gguf is not None:
        from pagedserve.dataplane.runner.gguf_loader import load_gguf_model

        return build_causal_lm(load_gguf_model(path, gguf, attn), model_impl)
    if model_impl != "transformers":
        owned = _load_owned(path, dtype, device, quantization)
        if owned is not None:
            return owned
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=DTYPES[dtype],
        attn_implementation=attn,
        local_files_only=True,
    )
    model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers stubs type .to oddly
    model.eval()
    model.requires_grad_(False)
    if quantization:
        quantize_linears(model, quantization)
    return build_causal_lm(model, model_impl)


def _load_owned(path: Path, dtype: str, device: str, quantization: str | None) -> CausalLM | None:
    """The owned model read straight from the folder's safetensors, or None when its
    architecture has none here (dataplane/src/pagedserve/dataplane/models/safetensors_loader.py)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = load_owned_safetensors(
        path, config, DTYPES[dtype], torch.device(device), register_paged_attention()
    )
    if model is None:
        return None
    model.eval()
    if quantization:
        quantize_linears(model, quantization)
    log.info(
        "model_implementation",
        implementation="pagedserve",
        architecture=config.architectures,
        weights="safetensors",
    )
    return model


def load_tokenizer(path: Path) -> Any | None:
    """The folder's tokenizer, or None when it ships none (token-id prompts still work)."""
    from transformers import AutoTokenizer

    if not any(
        (path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
