"""Lean decoder layers for the Llama family, applied to a built model as a load-time transform.

Why: transformers' decoder layers run seven projections per layer (q, k, v, o, gate, up,
down), rotary and RMSNorm as chains of small ops, and reach our paged attention through
its attention interface. At decode row counts each small op costs about as much in dispatch
as in arithmetic. `fuse_decoder_layers` replaces every decoder layer of a known
architecture with a `FusedDecoderLayer`: q/k/v as one linear and gate/up as one (wider
matmuls, fewer calls), rotary applied to q and k in one pass from tables derived once per
step, residual adds in place, and the paged attention called directly.

It runs after any tensor-parallel sharding and before `pack_linears`: q/k/v/gate/up may be
row shards (local heads only), o_proj/down_proj may be wrapper modules that all-reduce
their output, so head counts come from the projections' shapes, never from the config, and
o_proj/down_proj are called as the modules they are. Every math step is the one
transformers computes, in the same order, so the results equal the unfused model's up to
the accumulation order of the wider matmuls.

On the CPU in fp32 the work between the matmuls runs in our C++ kernels
(kernels/cpu/layer_ops.cpp, passed in as `cpu_ops`): RMSNorm, the residual add fused with the
next RMSNorm, rotary for q and k, and SiLU times up, each one pass instead of a chain of
torch ops. Residual adds and rotary are bit-identical to torch; RMSNorm and SiLU differ in
the last bits (sum order, exp polynomial). Without `cpu_ops` the same steps run in torch.

Once the linears are panel-packed (`pack_linears`), `bind_block_kernels` lets each layer run
its two halves around attention as one C++ op each (kernels/cpu/decoder_block.cpp): norm,
q/k/v projection and rotary; then o_proj with its residual add, norm, gate/up, SiLU, down
with its residual add. Same kernels in the same order, so bit-identical to the op-by-op path,
without its ~10 Python-level calls per layer. A half whose linears are not all panel-packed
(tensor-parallel o/down wrappers) or that has a q/k norm (Qwen3) keeps the op-by-op path.

Unknown architectures keep transformers' modules (logged).
"""

from __future__ import annotations

import logging
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.dataplane.runner.attention_hook import PagedStep, paged_layer_attention
from pagedserve.dataplane.runner.cpu_linear import PanelLinear
from pagedserve.dataplane.runner.quant_linear import QuantLinear, QuantPanelLinear
from pagedserve.kernels.cpu_ext import CpuKernels

log = logging.getLogger(__name__)

# Decoder layer classes whose forward is exactly: pre-norm attention (q/k/v/o projections,
# optional q_norm/k_norm over head_dim before rotary), residual, pre-norm gated MLP
# (act(gate) * up -> down), residual. Sliding-window configs attend over the whole context
# in our paged kernels either way (as through the attention hook).
FUSABLE_LAYERS = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)

# Activation classes that compute F.silu: torch's, and transformers' ACT2FN["silu"].
SILU_ACTIVATIONS = frozenset({"SiLU", "SiLUActivation"})


def _concat_linears(linears: list[nn.Linear]) -> nn.Module:
    """One linear whose output is the given linears' outputs side by side (rows stacked): an
    nn.Linear, or a QuantLinear for quantized ones (a GGUF model's)."""
    if all(isinstance(lin, QuantLinear) for lin in linears):
        return QuantLinear.concat(linears)  # type: ignore[arg-type]  # narrowed by the check
    first = linears[0]
    if any(not isinstance(lin, nn.Linear) for lin in linears):
        raise TypeError(f"expected nn.Linear projections, got {[type(lin).__name__ for lin in linears]}")
    if any(lin.in_features != first.in_features for lin in linears):
        raise ValueError(f"projections differ in in_features: {[lin.in_features for lin in linears]}")
    has_bias = [lin.bias is not None for lin in linears]
    fused = nn.Linear(
        first.in_features,
        sum(lin.out_features for lin in linears),
        bias=any(has_bias),
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears], dim=0))
        if fused.bias is not None:
            # A projection without bias contributes zeros: adding 0.0 changes no value.
            fused.bias.copy_(
                torch.cat(
                    [
                        lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                        for lin in linears
                    ]
                )
            )
    fused.requires_grad_(False)
    return fused


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
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, ops: CpuKernels | None
) -> torch.Tensor:
    """residual += delta (in place), then returns rms_norm(residual): one pass with `ops`."""
    if ops is None:
        residual += delta
        return rms_norm(residual, weight, eps)
    out = torch.empty_like(residual)
    ops.add_rms_norm(out, residual, delta, weight, eps)
    return out


def input_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: CpuKernels | None) -> torch.Tensor:
    """rms_norm(x) over the last dim of a [T, hidden] x: one pass with `ops`."""
    if ops is None:
        return rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, eps)
    return out


def apply_rotary(
    qk: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    tables: RotaryTables,
    ops: CpuKernels | None,
) -> torch.Tensor:
    """q*cos + rotate_half(q)*sin for q and k at once; qk: [T, H + KVH, D]. With `ops` qk is
    rotated in place (and returned), else a new tensor is returned."""
    cos, sin = position_embeddings
    if ops is not None:
        ops.rotary_neox(qk, *tables.flat(cos, sin))
        return qk
    c, sin_signed = tables.get(cos, sin)
    return qk * c + qk.roll(qk.shape[-1] // 2, dims=-1) * sin_signed


def silu_and_mul(gate_up: torch.Tensor, act_fn: nn.Module, ops: CpuKernels | None) -> torch.Tensor:
    """act_fn(gate) * up for gate_up = [gate | up] side by side: [T, 2I] -> [T, I]. `ops` only
    when act_fn is SiLU (the layer checks)."""
    inter = gate_up.shape[-1] // 2
    if ops is None:
        return act_fn(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    out = gate_up.new_empty(gate_up.shape[0], inter)
    ops.silu_and_mul(out, gate_up)
    return out


class RotaryTables:
    """cos and sign-folded sin in the [T, 1, D] layout our layers use, derived once per step.

    transformers' model computes (cos, sin) once per forward and hands the same tensors to
    every layer; the first layer of the step derives these views and the others reuse them
    (recognised by the identity of the cos tensor, which this object keeps alive so the
    identity cannot be reused by another tensor).

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed negates the first
    half of sin: -x2 * s == x2 * (-s) exactly, so the rotation is bit-identical.
    """

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flat_source: torch.Tensor | None = None
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def flat(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as the [T, D] tables the C++ rotary reads (views, once per step)."""
        if self._flat is None or self._flat_source is not cos:
            # cos, sin: [1, T, D], contiguous as transformers' rotary module makes them
            self._flat = (cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]))
            self._flat_source = cos
        return self._flat

    def get(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._source is not cos:
            # cos, sin: [1, T, D] (batch 1: the runner flattens the batch)
            half = cos.shape[-1] // 2
            c = cos.reshape(-1, 1, cos.shape[-1])
            s = sin.reshape(-1, 1, sin.shape[-1])
            self._tables = (c, torch.cat((-s[..., :half], s[..., half:]), dim=-1))
            self._source = cos
        return self._tables


class FusedDecoderLayer(nn.Module):
    """One Llama-family decoder layer: fused projections, our paged attention, in-place residuals."""

    qkv_proj: nn.Module
    gate_up_proj: nn.Module
    o_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module
    # transformers' RMSNorm modules (weight, variance_epsilon), kept so their weights stay
    # where a state-dict reader expects them.
    input_layernorm: Any
    post_attention_layernorm: Any

    def __init__(
        self, layer: Any, layer_idx: int, rotary: RotaryTables, cpu_ops: CpuKernels | None = None
    ) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = layer_idx
        self.rotary = rotary
        # The C++ kernels only where they compute what this layer computes: fp32 CPU weights
        # and SiLU (transformers' "silu" is its SiLUActivation, a plain F.silu).
        fp32 = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in layer.parameters())
        silu = type(mlp.act_fn).__name__ in SILU_ACTIVATIONS
        self.cpu_ops = cpu_ops if fp32 and silu else None
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        # Local head counts from the (possibly sharded) projections, not from the config.
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        if attn.v_proj.out_features != self.num_kv_heads * self.head_dim:
            raise ValueError(
                f"layer {layer_idx}: v_proj has {attn.v_proj.out_features} outputs, k_proj "
                f"{attn.k_proj.out_features}; they must match"
            )
        self.qkv_proj = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.o_proj = attn.o_proj
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        # bind_block_kernels: the C++ ops' arguments after hidden_states for each half of the
        # layer (None: that half runs op by op).
        self.attention_input_args: tuple[Any, ...] | None = None
        self.attention_input_int8 = False  # the op's last argument, after the rotary tables
        self.mlp_args: tuple[Any, ...] | None = None
        # Qwen3: per-head RMSNorm of q and k before rotary. q and k are adjacent in the fused
        # output, so one norm over [T, H + KVH, D] with the two weights stacked per head
        # computes both (each row is normalised on its own, as in the separate norms).
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm_weight: torch.Tensor | None
        self.qk_norm_eps = 0.0
        if q_norm is None or k_norm is None:
            self.register_buffer("qk_norm_weight", None, persistent=False)
        else:
            weight = torch.cat(
                [
                    q_norm.weight.detach().expand(self.num_heads, self.head_dim),
                    k_norm.weight.detach().expand(self.num_kv_heads, self.head_dim),
                ]
            )
            self.register_buffer("qk_norm_weight", weight, persistent=False)
            self.qk_norm_eps = float(q_norm.variance_epsilon)
            if float(k_norm.variance_epsilon) != self.qk_norm_eps:
                raise ValueError(f"layer {layer_idx}: q_norm and k_norm eps differ")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        paged_step: PagedStep | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """hidden_states: [1, T, hidden] (the runner's flattened batch) -> [1, T, hidden]."""
        if paged_step is None:
            raise RuntimeError(
                "fused decoder layers need the `paged_step` argument; run them through ModelRunner"
            )
        h = hidden_states[0]  # [T, hidden]; the residual stream, updated in place
        num_tokens = h.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        ops = self.cpu_ops
        qk_width = (heads + kv_heads) * head_dim
        if self.attention_input_args is not None and ops is not None:
            qkv = ops.decoder_attention_input(
                h,
                *self.attention_input_args,
                *self.rotary.flat(*position_embeddings),
                heads + kv_heads,
                self.attention_input_int8,
            )  # [T, (H + 2 KVH) D], q and k rotated
            qk = qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim)
        else:
            norm = self.input_layernorm
            qkv = self.qkv_proj(input_rms_norm(h, norm.weight, norm.variance_epsilon, ops))
            qk = qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim)
            if self.qk_norm_weight is not None:
                qk = rms_norm(qk, self.qk_norm_weight, self.qk_norm_eps)
            qk = apply_rotary(qk, position_embeddings, self.rotary, ops)  # [T, H + KVH, D]
        v = qkv[:, qk_width:].view(num_tokens, kv_heads, head_dim)
        out = paged_layer_attention(
            paged_step, self.layer_idx, qk[:, :heads], qk[:, heads:], v, self.scaling
        )  # [T, H, D]
        if self.mlp_args is not None and ops is not None:
            ops.decoder_mlp(h, out.view(num_tokens, heads * head_dim), *self.mlp_args)
            return hidden_states
        norm = self.post_attention_layernorm
        attn_out = self.o_proj(out.view(num_tokens, heads * head_dim))
        gate_up = self.gate_up_proj(
            add_rms_norm(h, attn_out, norm.weight, norm.variance_epsilon, ops)
        )  # [T, 2 I]
        h += self.down_proj(silu_and_mul(gate_up, self.act_fn, ops))
        return hidden_states

    def bind_block_kernels(self) -> tuple[bool, bool]:
        """Let each half of the layer run as one C++ op where it can (module docstring);
        returns whether the attention-input half and the MLP half do."""
        if self.cpu_ops is None:
            return False, False
        qkv, o, gate_up, down = self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

        # The block ops run each linear's panel matmul, fp32 or bf16 weights alike.
        if _panels(qkv) and self.qk_norm_weight is None:
            norm = self.input_layernorm
            self.attention_input_args = (
                norm.weight.detach(),
                float(norm.variance_epsilon),
                qkv.panels,
                qkv.kernel_bias,
                qkv.out_features,
            )
            self.attention_input_int8 = _int8_activations(qkv)
        if _panels(o) and _panels(gate_up) and _panels(down):
            norm = self.post_attention_layernorm
            self.mlp_args = (
                o.panels, o.kernel_bias, norm.weight.detach(), float(norm.variance_epsilon),
                gate_up.panels, gate_up.kernel_bias, gate_up.out_features // 2, down.panels, down.kernel_bias,
                _int8_activations(o, gate_up, down),
            )  # fmt: skip
        return self.attention_input_args is not None, self.mlp_args is not None


def _panels(linear: object) -> TypeGuard[PanelLinear | QuantPanelLinear]:
    """A linear the block ops take: fp32 / bf16 panels, or quantized panels (a GGUF model's)."""
    return isinstance(linear, (PanelLinear, QuantPanelLinear))


def _int8_activations(*linears: object) -> bool:
    """Whether the block op's quantized linears multiply by integer dot products (the op takes
    one flag for all of its linears; the fp32 / bf16 ones ignore it)."""
    return any(isinstance(lin, QuantPanelLinear) and lin.int8_activations for lin in linears)


def bind_block_kernels(model: nn.Module) -> tuple[int, int]:
    """After `pack_linears`: each fused layer runs its attention-input and MLP halves as one
    C++ op each where it can; returns how many layers do, per half."""
    bound = [layer.bind_block_kernels() for layer in model.modules() if isinstance(layer, FusedDecoderLayer)]
    attention_input, mlp = sum(a for a, _ in bound), sum(m for _, m in bound)
    if bound:
        log.info(
            "fused layers: %d of %d run attention input as one C++ op, %d the MLP half",
            attention_input, len(bound), mlp,
        )  # fmt: skip
    return attention_input, mlp


def fuse_decoder_layers(model: nn.Module, cpu_ops: CpuKernels | None = None) -> int:
    """Replace the decoder layers of a known architecture in place; returns how many were
    replaced (0: the model keeps transformers' layers, which the attention hook serves).

    cpu_ops: the C++ CPU kernels (pagedserve.kernels.cpu_ext.load_cpu_kernels) for the elementwise work,
    used by layers whose weights are fp32 on the CPU; None: torch ops throughout."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        log.info(
            "fused layers: %s has no decoder layer list; keeping transformers' layers", type(model).__name__
        )
        return 0
    kinds = {type(layer).__name__ for layer in layers}
    if kinds == {FusedDecoderLayer.__name__}:
        log.debug("fused layers: %s's layers are fused already", type(model).__name__)
        return 0
    if not kinds <= FUSABLE_LAYERS:
        log.info("fused layers: no lean implementation of %s; keeping transformers' layers", sorted(kinds))
        return 0
    rotary = RotaryTables()
    for i, layer in enumerate(layers):
        attn: Any = layer.self_attn
        layers[i] = FusedDecoderLayer(layer, int(attn.layer_idx), rotary, cpu_ops)
    with_ops = sum(
        1 for layer in layers if isinstance(layer, FusedDecoderLayer) and layer.cpu_ops is not None
    )
    log.info(
        "fused layers: %d %s layers use fused q/k/v and gate/up projections%s",
        len(layers),
        sorted(kinds),
        f", {with_ops} of them the C++ elementwise kernels" if cpu_ops is not None else "",
    )
    return len(layers)
