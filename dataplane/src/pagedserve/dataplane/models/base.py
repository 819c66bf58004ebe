"""What the runner needs of a model: one forward over a flattened step, and its logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.models.attention import PagedStep
from pagedserve.kernels.cpu_ext import CpuKernels


class CausalLM(nn.Module):
    """A decoder-only LM as the engine runs it.

    `forward(input_ids [T], positions [T], step) -> hidden [T, hidden]`: the final (normed)
    hidden states of the step's T tokens, all sequences flattened into one varlen batch; the
    layers write the new tokens' K/V into `step`'s paged caches. `compute_logits` maps the
    rows the sampler needs to the vocabulary.

    Load-time transforms (pagedserve.dataplane.runner: linear packing, quantized panels,
    tensor-parallel sharding) replace the nn.Linear modules of a built model; the hooks below
    let the model use the C++ CPU kernels around them.
    """

    config: Any
    generation_config: Any
    implementation: str  # "pagedserve" (owned) or "transformers"

    def __init__(self, config: Any, dtype: torch.dtype, generation_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a quantized model's too: float32)."""
        return self._dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep) -> torch.Tensor:
        raise NotImplementedError

    def output_embeddings(self) -> nn.Module:
        """The LM head module (as the load-time transforms left it)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]."""
        logits: torch.Tensor = self.output_embeddings()(hidden)
        return logits

    def use_cpu_kernels(self, ops: CpuKernels | None) -> int:
        """Let the layers run their elementwise work in the C++ kernels where they compute what
        the layer does (fp32 CPU weights); returns how many layers do. None: torch ops."""
        return 0

    def bind_block_kernels(self) -> tuple[int, int]:
        """After linear packing: each layer runs its attention-input and MLP halves as one C++
        op each where it can; returns how many layers do, per half."""
        return 0, 0
