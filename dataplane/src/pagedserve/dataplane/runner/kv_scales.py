"""Per-layer K and V scales of an FP8 KV cache: calibration at start-up, or a JSON file.

The cache stores fp8(x / scale). A layer's scale maps the largest |K| (or |V|) seen on a
short calibration text to FP8_MAX / SCALE_HEADROOM: values up to SCALE_HEADROOM times the
calibrated maximum still fit before saturating, which costs only log2(SCALE_HEADROOM)
binades at the bottom of FP8's range (where values matter least next to the large ones).

File format (what `KVScales.save` writes, what --kv-scales-path reads):
    {"kv_cache_dtype": "fp8_e4m3", "k_scale": [per layer...], "v_scale": [per layer...]}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.dataplane.models import CausalLM, PagedStep
from pagedserve.kernels import build_attention_metadata
from pagedserve.kernels.backend import ResolvedBackends, default_backend
from pagedserve.kernels.fp8 import fp8_max

SCALE_HEADROOM = 2.0
CALIBRATION_TOKENS = 512

# Plain English prose (written for this project): calibration needs ordinary text, and the
# model's chat template around it when it has one, so the first tokens' large activations
# (attention sinks) are seen too.
CALIBRATION_TEXT = """\
The library opened at nine every morning, and by ten the reading room was usually half full.
Students came with laptops and paper notes, retired engineers came to read the newspapers,
and a few regulars arrived with questions they had been saving all week. One of them wanted
to know why bridges are built with expansion joints; another asked how bees find their way
home after a long flight. The librarian answered what she could and pointed to the right
shelves for the rest. Heat makes steel grow a little longer, she explained, so a long bridge
needs gaps that can open and close with the seasons, or the deck would buckle in summer and
crack in winter. Bees, she said, remember the position of the sun and the shape of the land,
and they share directions with a dance inside the hive. In the afternoon a teacher brought a
class of twelve-year-olds who were studying the history of the town. They learned that the
river had once powered three mills, that the railway arrived in 1871, and that the old
market hall burned down twice before it was rebuilt in stone. A boy asked whether anyone
had written down what people ate back then. There were cookbooks, it turned out, full of
recipes for bread, soups, preserved fruit and roasted vegetables, with careful notes on how
long each dish could be kept through the winter. The children copied a recipe for apple cake
and promised to bake it at home. Before closing, the librarian checked the returns, sorted
the new arrivals about astronomy, cooking and computer programming, and wrote a short list of
questions for the next day: how do vaccines train the immune system, what makes a good cup of
coffee, and why is the sky blue? Then she switched off the lights and locked the door.
"""


@dataclass(frozen=True)
class KVScales:
    """One (k_scale, v_scale) per layer, and where they came from (for the logs)."""

    k_scale: tuple[float, ...]
    v_scale: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.k_scale) != len(self.v_scale):
            raise ValueError(f"{len(self.k_scale)} k scales but {len(self.v_scale)} v scales")
        for s in (*self.k_scale, *self.v_scale):
            if not (s > 0.0 and math.isfinite(s)):
                raise ValueError(f"KV scales must be positive and finite, got {s}")

    @property
    def num_layers(self) -> int:
        return len(self.k_scale)

    def per_layer(self) -> list[tuple[float, float]]:
        return list(zip(self.k_scale, self.v_scale, strict=True))

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers, "default 1.0")

    def save(self, path: str | Path, kv_cache_dtype: str) -> None:
        payload = {
            "kv_cache_dtype": kv_cache_dtype,
            "k_scale": list(self.k_scale),
            "v_scale": list(self.v_scale),
        }
        Path(path).write_text(json.dumps(payload, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, num_layers: int, kv_cache_dtype: str) -> KVScales:
        """Read a scales file; ValueError when it does not fit the model or the FP8 format."""
        try:
            data: Any = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a KV scales JSON file: {exc}") from exc
        if not isinstance(data, dict) or "k_scale" not in data or "v_scale" not in data:
            raise ValueError(f'{path}: expected {{"k_scale": [...], "v_scale": [...]}}')
        stored = data.get("kv_cache_dtype")
        if stored is not None and stored != kv_cache_dtype:
            # e5m2 and e4m3 scales differ ~128x: using one format's scales for the other
            # would saturate or waste most of the range.
            raise ValueError(f"{path} holds scales for {stored}, not {kv_cache_dtype}")
        k, v = data["k_scale"], data["v_scale"]
        if isinstance(k, int | float):
            k = [k] * num_layers
        if isinstance(v, int | float):
            v = [v] * num_layers
        if len(k) != num_layers or len(v) != num_layers:
            raise ValueError(f"{path}: {len(k)} k / {len(v)} v scales for a model of {num_layers} layers")
        return cls(tuple(float(x) for x in k), tuple(float(x) for x in v), f"file {path}")


def calibration_token_ids(
    tokenizer: Any | None, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS
) -> list[int]:
    """CALIBRATION_TEXT as the model sees a chat prompt; seeded random ids without a tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": CALIBRATION_TEXT}]
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = list(out["input_ids"])
    else:
        ids = list(tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True))
    return ids[:num_tokens]


@torch.inference_mode()
def calibrate_kv_scales(
    model: CausalLM, token_ids: list[int], fp8: torch.dtype, block_size: int = 16
) -> KVScales:
    """Run one prefill of token_ids through the paged attention and derive per-layer scales.

    The pass uses a temporary cache in the model's dtype just large enough for the prompt;
    scale = max|x| * SCALE_HEADROOM / FP8_MAX per layer, for K and V separately.
    """
    cfg = model.config
    num_layers: int = cfg.num_hidden_layers
    head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    device = next(model.parameters()).device
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=model.dtype, device=device),
            torch.zeros(shape, dtype=model.dtype, device=device),
        )
        for _ in range(num_layers)
    ]
    amax = torch.zeros(num_layers, 2, dtype=torch.float32)

    def observe(layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        amax[layer, 0] = max(float(amax[layer, 0]), float(key.abs().max()))
        amax[layer, 1] = max(float(amax[layer, 1]), float(value.abs().max()))

    meta = build_attention_metadata([n], [n], [list(range(num_blocks))], block_size, device)
    # The by-device backend for both ops: a prefill never reaches the C++ decode kernel, so
    # calibration skips resolve_backend's build of it (the engine builds it afterwards).
    backend = default_backend(device, model.dtype)
    step = PagedStep(
        meta,
        caches,
        ResolvedBackends(attention=backend, cache=backend, cache_write=backend),
        observer=observe,
    )
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model(ids, torch.arange(n, device=device), step)
    # A layer whose K or V is all zeros (never in practice) keeps scale 1.
    scales = torch.where(amax > 0, amax * SCALE_HEADROOM / fp8_max(fp8), torch.ones_like(amax))
    return KVScales(tuple(scales[:, 0].tolist()), tuple(scales[:, 1].tolist()), f"calibrated on {n} tokens")
