"""The models the engine runs: owned forward passes (the Llama family) and the transformers fallback."""

from pagedserve.dataplane.models.attention import PagedStep, paged_layer_attention
from pagedserve.dataplane.models.base import CausalLM
from pagedserve.dataplane.models.from_transformers import build_causal_lm
from pagedserve.dataplane.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.dataplane.models.transformers_backend import TransformersCausalLM

__all__ = [
    "CausalLM",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "PagedStep",
    "TransformersCausalLM",
    "build_causal_lm",
    "paged_layer_attention",
]
