"""The Megatron split of a loaded transformers decoder, applied in place as a transform.

Per decoder layer, rank r of N keeps:
- column-parallel q/k/v_proj and gate/up_proj: its 1/N of the output rows (bias too), i.e.
  query heads [r*H/N, (r+1)*H/N), KV heads [r*KVH/N, (r+1)*KVH/N) (the query heads of a
  contiguous range use exactly the KV heads of the matching range, so GQA stays local), and
  its 1/N of the MLP's intermediate features;
- row-parallel o_proj and down_proj: the matching 1/N of the input columns, wrapped in a
  `RowParallelLinear` that all-reduces the partial sums (the bias is added once, after).

Embeddings, norms and the LM head stay whole. transformers' attention modules reshape their
projections with -1 heads (Llama, Qwen2, Qwen3, Mistral), so they run on the local heads
unchanged; their num_key_value_groups (H/KVH) is the same ratio locally. Runs before any other
load-time transform (fusing q/k/v, oneDNN packing): those see plain, already-sharded nn.Linear
modules, `RowParallelLinear.linear` included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.parallel.group import TensorParallelGroup


def check_divisible(config: Any, tensor_parallel_size: int) -> None:
    """Raise ValueError unless the model's heads and MLP split evenly into N ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(getattr(config, name))
        if value % tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} must divide the model's {name} ({value})"
            )


class RowParallelLinear(nn.Module):
    """A row-parallel linear: this rank's input columns (`linear`, no bias), the partial
    outputs summed over the group, then the bias once."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        self.group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


def _rows(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """The column-parallel shard: output rows [rank*out/N, (rank+1)*out/N)."""
    per_rank = linear.out_features // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    shard = nn.Linear(linear.in_features, per_rank, bias=linear.bias is not None)
    shard = shard.to(device=linear.weight.device, dtype=linear.weight.dtype)
    shard.weight = nn.Parameter(linear.weight.detach()[part].clone(), requires_grad=False)
    if linear.bias is not None:
        shard.bias = nn.Parameter(linear.bias.detach()[part].clone(), requires_grad=False)
    return shard


def _columns(linear: nn.Linear, rank: int, group: TensorParallelGroup) -> RowParallelLinear:
    """The row-parallel shard: input columns [rank*in/N, (rank+1)*in/N), bias kept aside."""
    per_rank = linear.in_features // group.world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    shard = nn.Linear(per_rank, linear.out_features, bias=False)
    shard = shard.to(device=linear.weight.device, dtype=linear.weight.dtype)
    shard.weight = nn.Parameter(linear.weight.detach()[:, part].clone(), requires_grad=False)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(shard, bias, group)


def shard_model(model: Any, group: TensorParallelGroup) -> int:
    """Split every decoder layer of `model` for `group`'s rank, in place; returns the number of
    layers split. Raises ValueError when the heads or MLP do not divide evenly."""
    rank, world_size = group.rank, group.world_size
    check_divisible(model.config, world_size)
    layers = model.get_decoder().layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _rows(getattr(attn, name), rank, world_size))
        attn.o_proj = _columns(attn.o_proj, rank, group)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, _rows(getattr(mlp, name), rank, world_size))
        mlp.down_proj = _columns(mlp.down_proj, rank, group)
    return len(layers)
