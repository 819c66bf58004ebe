"""Builds a transformers model class from a local config + safetensors folder, with our attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedserve.common.models.gguf_folder import gguf_weights_file
from pagedserve.dataplane.runner.attention_hook import register_paged_attention

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_model(path: Path, dtype: str, device: str) -> Any:
    """Load the causal LM in `path` (never from a hub) with pagedserve's paged attention. A
    GGUF folder's weights stay quantized (gguf_loader.py): CPU and float32 activations only."""
    from transformers import AutoModelForCausalLM

    attn = register_paged_attention()
    gguf = gguf_weights_file(path)
    if gguf is not None:
        if dtype != "float32" or torch.device(device).type != "cpu":
            raise ValueError(
                f"a GGUF model ({gguf.name}) runs on the CPU with float32 activations: "
                f"--dtype float32 --device cpu, not --dtype {dtype} --device {device}"
            )
        from pagedserve.dataplane.runner.gguf_loader import load_gguf_model

        return load_gguf_model(path, gguf, attn)
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=DTYPES[dtype],
        attn_implementation=attn,
        local_files_only=True,
    )
    model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers stubs type .to oddly
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: Path) -> Any | None:
    """The folder's tokenizer, or None when it ships none (token-id prompts still work)."""
    from transformers import AutoTokenizer

    if not any(
        (path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
