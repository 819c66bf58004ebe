"""Tiny random-weight models of the architectures we serve, a transformers reference, and the
exactness workload the engine is held to (the test suite and `gpu_check` share them).

Weights are drawn with a larger init scale than the library default so that logits have
decisive margins; exact-token comparisons then fail only on genuine numerical ties, which
`assert_same_greedy` recognises by the reference's own top-2 margin (below TIE_TOLERANCE,
relative to its top logit).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 384
TIE_TOLERANCE = 1e-4  # fp32: batched and one-at-a-time matmuls may differ in the last bits
EXACTNESS_PROMPTS = 32


def exactness_workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """32 prompts of mixed lengths (1..70 tokens) with their own output lengths (1..20)."""
    rng = random.Random(seed)
    items = []
    for i in range(EXACTNESS_PROMPTS):
        length = 1 if i == 0 else rng.randint(2, 70)
        items.append(([rng.randrange(3, VOCAB) for _ in range(length)], rng.randint(1, 20)))
    return items


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A tiny random-weight config of `arch`; `overrides` replace any of the shared fields."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama-mha":
        return LlamaConfig(**{**common, "num_key_value_heads": 4})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "num_attention_heads": 6, "head_dim": 16, "num_key_value_heads": 2})
    if arch == "mistral":
        return MistralConfig(
            **{**common, "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": None}
        )
    raise ValueError(arch)


def make_tiny_model(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight model of `arch` (config + safetensors, no tokenizer) to `directory`;
    `overrides` replace config fields (as in tiny_config)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@dataclass
class Reference:
    tokens: list[int]
    scores: list[torch.Tensor]  # one [vocab] tensor of logits per generated position


def reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> Reference:
    """transformers' own generate, one prompt at a time, no padding (the model must not stop on EOS)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [s[0].float() for s in out.logits])


def load_reference_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    # Like our ignore_eos: never stop early. (min_new_tokens would instead forbid EOS, changing the argmax.)
    model.generation_config.eos_token_id = None
    return model.eval()


def assert_same_greedy(ours: list[int], ref: Reference, context: str = "") -> bool:
    """Assert token equality; a divergence passes only where the reference's top-2 logits tie.

    Returns True when the sequences matched exactly (False: accepted tie divergence).
    """
    assert len(ours) == len(ref.tokens), f"{context}: length {len(ours)} != reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a == b:
            continue
        top2 = ref.scores[i].topk(2)
        margin = float(top2.values[0] - top2.values[1])
        assert a == int(top2.indices[1]), f"{context}: token {i} is {a}, not even the reference's runner-up"
        tol = TIE_TOLERANCE * max(1.0, abs(float(top2.values[0])))
        assert margin < tol, (
            f"{context}: token {i} differs (ours {a}, reference {b}) and the reference margin "
            f"{margin:.3g} is not a numerical tie (< {tol:.3g})"
        )
        return False
    return True
