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
    """The whole owned model and each rank's shard of it."""
    full = load_model(path, "float32", "cpu")
    ranks = []
    for rank in range(world_size):
        model = load_model(path, "float32", "cpu")
        shard_model(model, LocalGroup(rank, world_size))  # type: ignore[arg-type]
        ranks.append(model)
    return full, ranks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_each_rank_keeps_its_heads_and_mlp_columns(arch: str, tmp_path: Path) -> None:
    cfg = tiny_config(arch)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kvh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    full, (r0, r1) = shards(make_tiny_model(arch, tmp_path), 2)
    for whole, a, b in zip(full.decoder_layers(), r0.decoder_layers(), r1.decoder_layers(), strict=True):
        w = whole.qkv_proj.weight
        q, k, v = w[: h * d], w[h * d : (h + kvh) * d], w[(h + kvh) * d :]
        for rank, shard in enumerate((a, b)):
            assert (shard.num_heads, shard.num_kv_heads) == (h // 2, kvh // 2)
            qs, ks = (
                slice(rank * h // 2 * d, (rank + 1) * h // 2 * d),
                slice(rank * kvh // 2 * d, (rank + 1) * kvh // 2 * d),
            )
            # this rank's query heads, then its KV heads' k and v rows, in that order
            assert torch.equal(shard.qkv_proj.weight, torch.cat([q[qs], k[ks], v[ks]]))
            if arch == "qwen2":  # q/k/v biases are split with their rows
                bias = whole.qkv_proj.bias
                want = torch.cat(
                    [bias[: h * d][qs], bias[h * d : (h + kvh) * d][ks], bias[(h + kvh) * d :][ks]]
                )
                assert torch.equal(shard.qkv_proj.bias, want)
            if arch == "qwen3":  # the stacked q/k norm weight follows the local head counts
                assert shard.qk_norm_weight is not None
                assert shard.qk_norm_weight.shape == (h // 2 + kvh // 2, d)
            gate_up = whole.gate_up_proj.weight
            cols = slice(rank * inter // 2, (rank + 1) * inter // 2)
            assert torch.equal(
                shard.gate_up_proj.weight, torch.cat([gate_up[:inter][cols], gate_up[inter:][cols]])
            )
            o_proj, down = shard.o_proj, shard.down_proj
            assert isinstance(o_proj, RowParallelLinear) and isinstance(o_proj.linear, nn.Linear)
            assert o_proj.linear.bias is None  # added once, after the reduce
            columns = slice(rank * h // 2 * d, (rank + 1) * h // 2 * d)
            assert torch.equal(o_proj.linear.weight, whole.o_proj.weight[:, columns])
            assert isinstance(down, RowParallelLinear) and down.linear.in_features == inter // 2


@torch.inference_mode()
def test_partial_outputs_sum_to_the_whole_layer(tmp_path: Path) -> None:
    from pagedserve.dataplane.models.layers import silu_and_mul

    full, ranks = shards(make_tiny_model("qwen2", tmp_path), 2)
    x = torch.randn(5, full.config.hidden_size)

    def mlp(layer: Any) -> torch.Tensor:
        return layer.down_proj(silu_and_mul(layer.gate_up_proj(x), None))

    want_mlp = mlp(full.decoder_layers()[0])
    got_mlp = sum(mlp(r.decoder_layers()[0]) for r in ranks)
    torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-5, atol=1e-5)
    # o_proj with its bias-free partials: the bias belongs to the sum once, not to each rank.
    heads_out = torch.randn(5, full.config.hidden_size)
    whole_o = full.decoder_layers()[0].o_proj
    parts = [r.decoder_layers()[0].o_proj.linear(heads_out.chunk(2, dim=-1)[i]) for i, r in enumerate(ranks)]
    torch.testing.assert_close(parts[0] + parts[1], whole_o(heads_out), rtol=1e-5, atol=1e-5)


def test_transformers_modules_are_not_split(tmp_path: Path) -> None:
    model = load_model(make_tiny_model("llama", tmp_path), "float32", "cpu", model_impl="transformers")
    with pytest.raises(ValueError, match="tensor parallelism splits the owned models only"):
        shard_model(model, LocalGroup(0, 2))  # type: ignore[arg-type]


def test_heads_that_do_not_divide_are_refused_by_name() -> None:
    cfg = tiny_config("qwen3")  # 6 query heads, 2 KV heads
    check_divisible(cfg, 2)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 must divide the model's num_key_value_heads \(2\)"
    ):
        check_divisible(cfg, 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        check_divisible(cfg, 4)
