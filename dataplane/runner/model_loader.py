"""Builds a transformers model class from a local config + safetensors folder, with our attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedserve.dataplane.runner.attention_hook import register_paged_attention

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_model(path: Path, dtype: str, device: str) -> Any:
    """Load the causal LM in `path` (never from a hub) with pagedserve's paged attention."""
    from transformers import AutoModelForCausalLM

    attn = register_paged_attention()
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
