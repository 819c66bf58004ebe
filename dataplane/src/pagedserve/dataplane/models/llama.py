"""The Llama family as the engine runs it: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norm).

One file shows the forward pass: token embedding; per layer, pre-norm attention (q/k/v as one
linear, optional per-head q/k RMSNorm, rotary, our paged attention, o projection) and a
pre-norm gated MLP (gate/up as one linear, SiLU times up, down projection), each added to the
residual stream in place; the final norm. The LM head is applied by `compute_logits` to the
rows that are sampled only.

Every math step is the one transformers computes, in the same order, so outputs equal
transformers' up to the accumulation order of the wider matmuls.

On the CPU in fp32 the elementwise work runs in our C++ kernels (`use_cpu_kernels`), and once
the linears are panel-packed each layer can run its two halves around attention as one C++ op
each (`bind_block_kernels`, kernels/src/pagedserve/kernels/cpu/decoder_block.cpp): norm, q/k/v projection and rotary;
then o_proj with its residual add, norm, gate/up, SiLU, down with its residual add. Same
kernels in the same order, so bit-identical to the op-by-op path. A half whose linears are
not all panel-packed (tensor-parallel o/down wrappers) or that has a q/k norm (Qwen3) runs
op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.dataplane.models.attention import PagedStep, paged_layer_attention
from pagedserve.dataplane.models.base import CausalLM
from pagedserve.dataplane.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    add_rms_norm,
    apply_rotary,
    input_rms_norm,
    rms_norm,
    silu_and_mul,
)
from pagedserve.kernels.cpu_ext import CpuKernels


class LlamaDecoderLayer(nn.Module):
    """One decoder layer over the step's [T, hidden] residual stream, which it updates in place.

    `num_heads` / `num_kv_heads` are this rank's (a tensor-parallel shard holds 1/N of them:
    `set_local_heads`)."""

    qk_norm_weight: torch.Tensor | None

    def __init__(
        self,
        layer_idx: int,
        *,
        qkv_proj: nn.Module,
        o_proj: nn.Module,
        gate_up_proj: nn.Module,
        down_proj: nn.Module,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        scaling: float,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.head_dim = head_dim
        self.scaling = scaling
        self.q_norm: RMSNorm | None = qk_norm[0] if qk_norm is not None else None
        self.k_norm: RMSNorm | None = qk_norm[1] if qk_norm is not None else None
        if qk_norm is not None and qk_norm[0].variance_epsilon != qk_norm[1].variance_epsilon:
            raise ValueError(f"layer {layer_idx}: q_norm and k_norm eps differ")
        self.cpu_ops: CpuKernels | None = None
        # bind_block_kernels: the C++ ops' arguments after the hidden states for each half of
        # the layer (None: that half runs op by op).
        self.attention_input_args: tuple[Any, ...] | None = None
        self.attention_input_int8 = False  # the op's last argument, after the rotary tables
        self.mlp_args: tuple[Any, ...] | None = None
        self.set_local_heads(num_heads, num_kv_heads)

    def set_local_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """The head counts this layer's projections hold (after a tensor-parallel split)."""
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        # Qwen3: q and k are adjacent in the fused output, so one norm over [T, H + KVH, D]
        # with the two weights stacked per head computes both (each row on its own).
        stacked = None
        if self.q_norm is not None and self.k_norm is not None:
            stacked = torch.cat(
                [
                    self.q_norm.weight.detach().expand(num_heads, self.head_dim),
                    self.k_norm.weight.detach().expand(num_kv_heads, self.head_dim),
                ]
            )
        self.register_buffer("qk_norm_weight", stacked, persistent=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: PagedStep) -> None:
        """h: [T, hidden], updated in place; cos/sin: [T, head_dim]."""
        num_tokens = h.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        ops = self.cpu_ops
        qk_width = (heads + kv_heads) * head_dim
        if self.attention_input_args is not None and ops is not None:
            qkv = ops.decoder_attention_input(
                h, *self.attention_input_args, cos, sin, heads + kv_heads, self.attention_input_int8
            )  # [T, (H + 2 KVH) D], q and k rotated
            qk = qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim)
        else:
            qkv = self.qkv_proj(input_rms_norm(h, self.input_layernorm, ops))
            qk = qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim)
            if self.qk_norm_weight is not None and self.q_norm is not None:
                qk = rms_norm(qk, self.qk_norm_weight, self.q_norm.variance_epsilon)
            qk = apply_rotary(qk, cos, sin, ops)  # [T, H + KVH, D]
        v = qkv[:, qk_width:].view(num_tokens, kv_heads, head_dim)
        out = paged_layer_attention(step, self.layer_idx, qk[:, :heads], qk[:, heads:], v, self.scaling)
        attn = out.view(num_tokens, heads * head_dim)  # [T, H * D]
        if self.mlp_args is not None and ops is not None:
            ops.decoder_mlp(h, attn, *self.mlp_args)
            return
        gate_up = self.gate_up_proj(add_rms_norm(h, self.o_proj(attn), self.post_attention_layernorm, ops))
        h += self.down_proj(silu_and_mul(gate_up, ops))

    def use_cpu_kernels(self, ops: CpuKernels | None) -> bool:
        """The C++ elementwise kernels only where they compute what this layer computes: fp32
        weights on the CPU."""
        fp32 = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in self.parameters())
        self.cpu_ops = ops if fp32 else None
        return self.cpu_ops is not None

    def bind_block_kernels(self) -> tuple[bool, bool]:
        """Let each half of the layer run as one C++ op where it can (module docstring);
        returns whether the attention-input half and the MLP half do."""
        if self.cpu_ops is None:
            return False, False
        qkv: Any = self.qkv_proj
        o: Any = self.o_proj
        gate_up: Any = self.gate_up_proj
        down: Any = self.down_proj
        if _panels(qkv) and self.qk_norm_weight is None:
            norm = self.input_layernorm
            self.attention_input_args = (
                norm.weight.detach(), norm.variance_epsilon, qkv.panels, qkv.kernel_bias, qkv.out_features,
            )  # fmt: skip
            self.attention_input_int8 = _int8_activations(qkv)
        if _panels(o) and _panels(gate_up) and _panels(down):
            norm = self.post_attention_layernorm
            self.mlp_args = (
                o.panels, o.kernel_bias, norm.weight.detach(), norm.variance_epsilon,
                gate_up.panels, gate_up.kernel_bias, gate_up.out_features // 2, down.panels, down.kernel_bias,
                _int8_activations(o, gate_up, down),
            )  # fmt: skip
        return self.attention_input_args is not None, self.mlp_args is not None


def _panels(linear: Any) -> bool:
    """A linear the block ops take: one holding column panels (fp32, bf16 or quantized) that
    the C++ ops read (pagedserve.dataplane.runner.cpu_linear / quant_linear)."""
    return isinstance(getattr(linear, "panels", None), torch.Tensor) and hasattr(linear, "kernel_bias")


def _int8_activations(*linears: Any) -> bool:
    """Whether the block op's quantized linears multiply by integer dot products (the op takes
    one flag for all of its linears; the fp32 / bf16 ones ignore it)."""
    return any(bool(getattr(lin, "int8_activations", False)) for lin in linears)


class LlamaForCausalLM(CausalLM):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model."""

    implementation = "pagedserve"

    def __init__(
        self,
        config: Any,
        *,
        embed_tokens: nn.Module,
        layers: list[LlamaDecoderLayer],
        norm: RMSNorm,
        lm_head: nn.Module,
        dtype: torch.dtype,
        generation_config: Any = None,
    ) -> None:
        super().__init__(config, dtype, generation_config)
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = RotaryEmbedding.from_config(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep) -> torch.Tensor:
        h: torch.Tensor = self.embed_tokens(input_ids)  # [T, hidden]: the residual stream
        cos, sin = self.rotary(positions, h.dtype)  # [T, head_dim] each, shared by the layers
        for layer in self.layers:
            layer(h, cos, sin, step)
        return self.norm(h)

    def output_embeddings(self) -> nn.Module:
        return self.lm_head

    def use_cpu_kernels(self, ops: CpuKernels | None) -> int:
        return sum(layer.use_cpu_kernels(ops) for layer in self.decoder_layers())

    def bind_block_kernels(self) -> tuple[int, int]:
        bound = [layer.bind_block_kernels() for layer in self.decoder_layers()]
        return sum(a for a, _ in bound), sum(m for _, m in bound)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
