"""Model shapes people deploy, as benchmark models: the layout of a public checkpoint with
seeded random weights and the default model's tokenizer.

`pagedserve bench throughput --model-shape qwen2-0.5b` runs on the Qwen2-0.5B layout without
downloading it: on first use the folder (config.json, model.safetensors in bf16, the default
model's tokenizer files) is written under `<cache>/model-shapes/<name>-<key>/`, where the cache is
$PAGEDSERVE_CACHE_HOME, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve. The key
hashes everything the files depend on (the config, the random seed, the init scale, the
storage dtype, the tokenizer), so a changed recipe writes a new folder and never reuses a stale one.

The vocabulary is the tokenizer's, not the checkpoint's, so the parameter counts are those
of the layout with that vocabulary (smaller than the checkpoint's: its embedding is).

Weights: each tensor from its own generator (seeded by the shape's seed and the tensor's name,
so one tensor does not depend on the order the others were drawn in), normal with std
INIT_STD, norms at one. Biases are drawn like weights rather than zeroed, so a bias the engine
dropped would change the tokens. Random weights give logits with small top-1/top-2 margins:
fine for speed, and `bench quality` shows what that means for agreement figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

# Shape name -> (transformers config class, the checkpoint's config fields). The vocabulary,
# bos/eos/pad ids come from the default model's tokenizer (`shape_config`).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-0.5b": (
        "Qwen2Config",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-1.5b": (
        "Qwen2Config",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "qwen3-1.7b": (
        "Qwen3Config",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
}
SEED = 0
# Small enough that the residual stream stays far from overflow through 28 layers, large
# enough that the logits are not all equal.
INIT_STD = 0.02
STORAGE_DTYPE = "bfloat16"
# Bumped when the way the weights are drawn or written changes (a new key, a new folder).
RECIPE_VERSION = 1
# The default model's files a shape folder takes as they are: the tokenizer and the chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def cache_root() -> Path:
    """$PAGEDSERVE_CACHE_HOME, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pagedserve"


def shape_config(name: str, tokenizer_config: dict[str, Any], **overrides: Any) -> Any:
    """The transformers config of shape `name` with the tokenizer's vocabulary and special
    token ids (`tokenizer_config`: the default model's config.json); `overrides` replace
    fields (a test shrinks num_hidden_layers)."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    class_name, fields = SHAPES[name]
    tokens = {k: tokenizer_config[k] for k in TOKEN_IDS if tokenizer_config.get(k) is not None}
    merged = {**fields, "vocab_size": int(tokenizer_config["vocab_size"]), **tokens, **overrides}
    merged["initializer_range"] = INIT_STD
    merged["dtype"] = STORAGE_DTYPE
    return getattr(transformers, class_name)(**merged)


def content_key(config: Any, tokenizer_dir: Path) -> str:
    """What a shape folder's files depend on, hashed: the config, the recipe, the tokenizer."""
    cfg = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    h = hashlib.sha256()
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(f"seed={SEED} std={INIT_STD} dtype={STORAGE_DTYPE} recipe={RECIPE_VERSION}".encode())
    for fname in TOKENIZER_FILES:
        path = tokenizer_dir / fname
        if path.is_file():
            h.update(fname.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def draw_weights(config: Any, seed: int = SEED) -> dict[str, Any]:
    """The shape's state dict: names and shapes from the model built on the meta device (no
    memory), each tensor drawn from its own generator; the tied LM head left out."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    dtype = getattr(torch, STORAGE_DTYPE)
    out: dict[str, Any] = {}
    for name, meta in skeleton.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            out[name] = torch.ones(meta.shape, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out[name] = (torch.randn(meta.shape, generator=gen) * INIT_STD).to(dtype)
    return out


def write_shape_model(config: Any, tokenizer_dir: Path, directory: Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of `config` to `directory`
    (made in a temporary folder beside it and renamed into place, so a killed run leaves no
    half-written folder that looks complete)."""
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        config.save_pretrained(tmp)
        save_file(draw_weights(config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for fname in TOKENIZER_FILES:
            if (tokenizer_dir / fname).is_file():
                shutil.copyfile(tokenizer_dir / fname, tmp / fname)
        # mkdtemp makes a private folder; the cache is shared like the model store.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        try:
            tmp.rename(directory)
        except OSError:  # another process wrote it first: theirs has the same content
            if not (directory / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def ensure_shape_model(
    name: str, tokenizer_model: str | None = None, root: Path | None = None, **overrides: Any
) -> Path:
    """The folder of shape `name`, written on first use (see the module docstring);
    `tokenizer_model` is the store model whose tokenizer it takes (default: the default model)."""
    from pagedserve.common.models import DEFAULT_MODEL, resolve_model_path

    tokenizer_dir = resolve_model_path(tokenizer_model or DEFAULT_MODEL)
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    config = shape_config(name, tokenizer_config, **overrides)
    directory = (root or cache_root()) / "model-shapes" / f"{name}-{content_key(config, tokenizer_dir)}"
    if (directory / "model.safetensors").is_file() and (directory / "config.json").is_file():
        return directory
    return write_shape_model(config, tokenizer_dir, directory)


def parameter_count(config: Any) -> int:
    """Parameters of the shape (the tied LM head counted once), from the meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in skeleton.parameters())
