"""The Megatron split of a loaded owned model (dataplane/src/pagedserve/dataplane/models/llama.py), applied in place.

Per decoder layer, rank r of N keeps:
- column-parallel qkv_proj and gate_up_proj: its 1/N of each part's output rows (bias too),
  i.e. query heads [r*H/N, (r+1)*H/N), KV heads [r*KVH/N, (r+1)*KVH/N) (the query heads of a
  contiguous range use exactly the KV heads of the matching range, so GQA stays local), and
  its 1/N of the MLP's intermediate features, gate's and up's alike;
- row-parallel o_proj and down_proj: the matching 1/N of the input columns, wrapped in a
  `RowParallelLinear` that all-reduces the partial sums (the bias is added once, after).

Embeddings, norms and the LM head stay whole. Runs before the runner's load-time transforms
(linear packing): those see plain, already-sharded nn.Linear modules, `RowParallelLinear.linear`
included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.models import CausalLM, LlamaForCausalLM
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


def _row_parts(linear: nn.Linear, parts: list[int], rank: int, world_size: int) -> nn.Linear:
    """The column-parallel shard of a linear whose output rows are `parts` side by side (q, k,
    v or gate, up): this rank's 1/N of each part's rows, in the same order."""
    keep: list[torch.Tensor] = []
    offset = 0
    for rows in parts:
        per_rank = rows // world_size
        keep.append(torch.arange(offset + rank * per_rank, offset + (rank + 1) * per_rank))
        offset += rows
    index = torch.cat(keep).to(linear.weight.device)
    shard = nn.Linear(linear.in_features, len(index), bias=linear.bias is not None)
    shard = shard.to(device=linear.weight.device, dtype=linear.weight.dtype)
    shard.weight = nn.Parameter(linear.weight.detach().index_select(0, index), requires_grad=False)
    if linear.bias is not None:
        shard.bias = nn.Parameter(linear.bias.detach().index_select(0, index), requires_grad=False)
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


def shard_model(model: CausalLM, group: TensorParallelGroup) -> int:
    """Split every decoder layer of `model` for `group`'s rank, in place; returns the number of
    layers split. Raises ValueError when the heads or MLP do not divide evenly, or the model
    is not an owned one (transformers' modules are not split)."""
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"tensor parallelism splits the owned models only (the Llama family); "
            f"{type(model).__name__} runs on one rank"
        )
    rank, world_size = group.rank, group.world_size
    check_divisible(model.config, world_size)
    layers = model.decoder_layers()
    for layer in layers:
        d, h, kvh = layer.head_dim, layer.num_heads, layer.num_kv_heads
        layer.qkv_proj = _row_parts(_linear(layer.qkv_proj), [h * d, kvh * d, kvh * d], rank, world_size)
        inter = _linear(layer.gate_up_proj).out_features // 2
        layer.gate_up_proj = _row_parts(_linear(layer.gate_up_proj), [inter, inter], rank, world_size)
        layer.o_proj = _columns(_linear(layer.o_proj), rank, group)
        layer.down_proj = _columns(_linear(layer.down_proj), rank, group)
        layer.set_local_heads(h // world_size, kvh // world_size)
    return len(layers)


def _linear(module: nn.Module) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise ValueError(f"tensor parallelism splits float nn.Linear layers, not {type(module).__name__}")
    return module
