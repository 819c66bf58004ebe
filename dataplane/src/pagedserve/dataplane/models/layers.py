"""The building blocks of the owned decoders: RMSNorm, rotary embedding, SiLU-and-multiply.

Each function computes what transformers' Llama-family modules compute, in the same order, so
an owned model's outputs equal transformers' up to the accumulation order of its wider
(fused) matmuls. With `ops` (the C++ CPU kernels, kernels/src/pagedserve/kernels/cpu/layer_ops.cpp; fp32 on the CPU
only) the elementwise work runs as one pass each: residual adds and rotary are bit-identical
to torch, RMSNorm and SiLU differ in the last bits (sum order, exp polynomial).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_ext import CpuKernels

# Rotary variants whose frequencies are fixed at load; the others (dynamic, longrope) change
# them with the sequence length inside transformers' module and stay with that backend.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class RMSNorm(nn.Module):
    """A norm's weight [D] and epsilon; applied through `rms_norm` / the C++ ops by its owner."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm over the last dim: normalise in fp32, cast back, then scale
    by `weight` ([D], or any shape broadcasting against x).

    In fp32 torch's fused kernel gives the same bits as transformers' chain of six ops (checked
    in tests) in one pass; other dtypes take that chain, which rounds between its steps.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # A weight per row as well (the stacked q/k norm weights): scale after normalising.
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm, ops: CpuKernels | None
) -> torch.Tensor:
    """residual += delta (in place), then returns norm(residual): one pass with `ops`."""
    if ops is None:
        residual += delta
        return rms_norm(residual, norm.weight, norm.variance_epsilon)
    out = torch.empty_like(residual)
    ops.add_rms_norm(out, residual, delta, norm.weight, norm.variance_epsilon)
    return out


def input_rms_norm(x: torch.Tensor, norm: RMSNorm, ops: CpuKernels | None) -> torch.Tensor:
    """norm(x) over the last dim of a [T, hidden] x: one pass with `ops`."""
    if ops is None:
        return rms_norm(x, norm.weight, norm.variance_epsilon)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, norm.weight, norm.variance_epsilon)
    return out


def silu_and_mul(gate_up: torch.Tensor, ops: CpuKernels | None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] side by side: [T, 2I] -> [T, I]."""
    inter = gate_up.shape[-1] // 2
    if ops is None:
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    out = gate_up.new_empty(gate_up.shape[0], inter)
    ops.silu_and_mul(out, gate_up)
    return out


class RotaryEmbedding(nn.Module):
    """The step's cos/sin tables from the positions, as transformers' rotary module makes them
    (inverse frequencies from the config's rope parameters, scaled by its attention factor)."""

    inv_freq: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float32), persistent=False)
        self.attention_scaling = float(attention_scaling)

    @classmethod
    def from_config(cls, config: Any) -> RotaryEmbedding:
        """The config's rope: default, linear, llama3 or yarn (`STATIC_ROPE_TYPES`)."""
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not one the owned models compute")
        if rope_type == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return cls(inv_freq, 1.0)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return cls(inv_freq, scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, D] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq.to(device=positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: CpuKernels | None
) -> torch.Tensor:
    """q*cos + rotate_half(q)*sin for q and k at once; qk: [T, H + KVH, D], cos/sin [T, D].
    With `ops` qk is rotated in place (and returned), else a new tensor is returned.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed negates the first
    half of sin: -x2 * s == x2 * (-s) exactly, so the rotation is bit-identical."""
    if ops is not None:
        ops.rotary_neox(qk, cos, sin)
        return qk
    half = cos.shape[-1] // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return qk * cos[:, None] + qk.roll(qk.shape[-1] // 2, dims=-1) * sin_signed[:, None]
