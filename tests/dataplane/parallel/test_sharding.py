"""The Megatron split, in one process: each rank keeps its rows/columns, and the ranks'
partial outputs sum to the whole layer's (what the all-reduce makes of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pagedserve.benchmarks.tiny_models import make_tiny_model, tiny_config
from pagedserve.dataplane.parallel.sharding import RowParallelLinear, check_divisible, shard_model
from pagedserve.dataplane.runner.model_loader import load_model


class LocalGroup:
    """A group of one rank's view whose all-reduce is left to the test (it sums the ranks)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass


def shards(path: Path, world_size: int) -> tuple[Any, list[Any]]:
    full = load_model(path, "float32", "cpu")
    ranks = []
    for rank in range(world_size):
        model = load_model(path, "float32", "cpu")
        shard_model(model, LocalGroup(rank, world_size))  # type: ignore[arg-type]
        ranks.append(model)
    return full, ranks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_rank_keeps_its_heads_and_mlp_columns(arch: str, tmp_path: Path) -> None:
    cfg = tiny_config(arch)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    full, (r0, r1) = shards(make_tiny_model(arch, tmp_path), 2)
    for whole, a, b in zip(full.model.layers, r0.model.layers, r1.model.layers, strict=True):
        for name, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
            w = getattr(whole.self_attn, name).weight
            half = heads // 2 * head_dim
            assert getattr(a.self_attn, name).weight.shape == (half, cfg.hidden_size)
            assert torch.equal(getattr(a.self_attn, name).weight, w[:half])
            assert torch.equal(getattr(b.self_attn, name).weight, w[half:])
            if arch == "qwen2":  # q/k/v biases are split with their rows
                bias = getattr(whole.self_attn, name).bias
                assert torch.equal(getattr(b.self_attn, name).bias, bias[half:])
        for rank, shard in enumerate((a, b)):
            o_proj, down = shard.self_attn.o_proj, shard.mlp.down_proj
            assert isinstance(o_proj, RowParallelLinear) and isinstance(o_proj.linear, nn.Linear)
            assert o_proj.linear.bias is None  # added once, after the reduce
            columns = slice(rank * cfg.hidden_size // 2, (rank + 1) * cfg.hidden_size // 2)
            assert torch.equal(o_proj.linear.weight, whole.self_attn.o_proj.weight[:, columns])
            assert down.linear.in_features == cfg.intermediate_size // 2
            assert shard.mlp.gate_proj.out_features == cfg.intermediate_size // 2


@torch.inference_mode()
def test_partial_outputs_sum_to_the_whole_layer(tmp_path: Path) -> None:
    full, ranks = shards(make_tiny_model("qwen2", tmp_path), 2)
    x = torch.randn(5, full.config.hidden_size)
    want_mlp = full.model.layers[0].mlp(x)
    got_mlp = sum(r.model.layers[0].mlp(x) for r in ranks)
    torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-5, atol=1e-5)
    # o_proj with its bias-free partials: the bias belongs to the sum once, not to each rank.
    heads_out = torch.randn(5, full.config.hidden_size)
    whole_o = full.model.layers[0].self_attn.o_proj
    parts = [
        r.model.layers[0].self_attn.o_proj.linear(heads_out.chunk(2, dim=-1)[i]) for i, r in enumerate(ranks)
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole_o(heads_out), rtol=1e-5, atol=1e-5)


def test_heads_that_do_not_divide_are_refused_by_name() -> None:
    cfg = tiny_config("qwen3")  # 6 query heads, 2 KV heads
    check_divisible(cfg, 2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 must divide the model's num_key_value_heads \(2\)"
    ):
        check_divisible(cfg, 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        check_divisible(cfg, 4)
