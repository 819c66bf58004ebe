"""Linear layers and embeddings whose weights stay quantized in memory (GGUF models).

A GGUF model's loader (gguf_loader.py) puts a `QuantLinear` where the checkpoint's linear
weight is quantized, and a `QuantEmbedding` for a quantized token embedding. Both hold a
pagedserve.kernels.quant.QuantizedWeight (values, per-group scales and mins). At load,
`pack_quant_linears` turns each QuantLinear into a `QuantPanelLinear`: the weight
reordered once into the C++ kernel's column panels (kernels/src/pagedserve/kernels/cpu/linear_quant.cpp), so a
decode step reads 4 or 8 bits per weight instead of 32. The kernel multiplies either by
integer dot products over the activations rounded to int8 per block of 32 (`--quantized-matmul
int8`, auto where the build has them, as llama.cpp does), or de-quantizes the weight in
registers and multiplies in fp32 (float32: bit-identical to the fp32 panels on the
de-quantized weight).

Without the C++ kernels a QuantLinear de-quantizes its weight on every call (correct, slow;
logged at load).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.dataplane.runner.cpu_linear import replace_module, rows_of
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import NO_BIAS
from pagedserve.kernels.quant import CHUNK_STEPS, QuantizedWeight, pack_quant_panels, quantize_int8

log = logging.getLogger(__name__)


def _register(module: nn.Module, prefix: str, weight: QuantizedWeight) -> None:
    """The weight's tensors as non-persistent buffers: counted by `buffers()` (memory
    accounting) and moved with the module."""
    module.register_buffer(f"{prefix}_values", weight.values, persistent=False)
    module.register_buffer(f"{prefix}_scales", weight.scales, persistent=False)
    if weight.mins is not None:
        module.register_buffer(f"{prefix}_mins", weight.mins, persistent=False)


class QuantLinear(nn.Module):
    """x @ weight.T + bias with `weight` a QuantizedWeight [out, in]."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        _register(self, "weight", weight)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        )

    @staticmethod
    def concat(linears: Sequence[QuantLinear]) -> QuantLinear:
        """One layer whose output is the layers' outputs side by side (fused q/k/v, gate/up)."""
        weight = QuantizedWeight.concat([lin.weight_q for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(lin.out_features)
                    for b, lin in zip(biases, linears, strict=True)
                ]
            )
        return QuantLinear(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_q.dequantize().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"in_features={self.in_features}, out_features={self.out_features}, {w.kind} ({w.bits}-bit, group {w.group})"


class QuantPanelLinear(nn.Module):
    """A QuantLinear packed into the C++ kernel's column panels (the build's ISA). Like
    PanelLinear it exposes `panels` (one tensor) and `kernel_bias`, so a fused decoder layer
    runs it inside its one-op halves (kernels/src/pagedserve/kernels/cpu/decoder_block.cpp)."""

    panels: torch.Tensor

    def __init__(self, linear: QuantLinear, ops: CpuKernels, *, int8_activations: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kind = linear.weight_q.kind
        self.int8_activations = int8_activations
        self._ops = ops
        self.register_buffer(
            "panels", pack_quant_panels(linear.weight_q, ops.panel_width).packed, persistent=False
        )
        self.bias = linear.bias

    @property
    def kernel_bias(self) -> torch.Tensor:
        """The bias as the C++ ops take it: the tensor, or NO_BIAS for none."""
        return NO_BIAS if self.bias is None else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = rows_of(x, self.in_features)
        out = flat.new_empty(flat.shape[0], self.out_features)
        self._ops.quant_panel_linear(out, flat, self.panels, self.kernel_bias, self.int8_activations)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        matmul = "int8 activations" if self.int8_activations else "float32"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, panels={self.kind}, {matmul}"
        )


class QuantEmbedding(nn.Module):
    """Token embedding rows de-quantized as they are looked up (a step touches few rows)."""

    def __init__(self, weight: QuantizedWeight, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.padding_idx = padding_idx
        _register(self, "weight", weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.dequantize(input_ids.reshape(-1))
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        w = self.weight_q
        return f"{self.num_embeddings}, {self.embedding_dim}, {w.kind} ({w.bits}-bit)"


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace every float nn.Linear of `model` by a QuantLinear of its weight quantized by
    `method` ("int8": per output channel, symmetric); returns how many were replaced."""
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        bias = None if linear.bias is None else linear.bias.detach()
        replace_module(model, name, QuantLinear(quantize_int8(linear.weight.detach()), bias))
    return len(targets)


def int8_activations(quantized_matmul: str, ops: CpuKernels | None) -> bool:
    """Whether quantized linears multiply by integer dot products over int8 activations:
    `quantized_matmul` ("auto", "int8", "float32"; the engine setting) on this build of the
    kernels; auto means where it has integer dot-product instructions (AVX2 or better)."""
    if quantized_matmul == "auto":
        return ops is not None and ops.int8_dot_products != "generic"
    return quantized_matmul == "int8"


def pack_quant_linears(model: nn.Module, ops: CpuKernels | None, *, int8_activations: bool = False) -> int:
    """Replace every QuantLinear of `model` by a QuantPanelLinear (with `ops`, multiplying by
    integer dot products with `int8_activations`); returns how many were replaced (0 without
    the C++ kernels: the layers then de-quantize per call). A weight whose group is not a
    multiple of 4 inputs (the kernel's chunk) stays a QuantLinear."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    if ops is None:
        if targets:
            log.warning(
                "%d quantized linears run without the C++ kernels: each de-quantizes its weight on "
                "every call (correct, several times slower; needs a C++ compiler and ninja)",
                len(targets),
            )
        return 0
    packable = [(name, m) for name, m in targets if m.weight_q.group % CHUNK_STEPS == 0]
    if len(packable) < len(targets):
        log.warning(
            "%d quantized linears have groups of inputs that are not a multiple of %d: they "
            "de-quantize their weights on every call (correct, slower)",
            len(targets) - len(packable),
            CHUNK_STEPS,
        )
    for name, linear in packable:
        replace_module(model, name, QuantPanelLinear(linear, ops, int8_activations=int8_activations))
    if packable:
        log.info(
            "%d quantized linears on the C++ kernel, multiplying %s",
            len(packable),
            f"by integer dot products ({ops.int8_dot_products}) over int8 activations"
            if int8_activations
            else "in float32 (weights de-quantized in registers)",
        )
    return len(packable)


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights as they sit in memory (parameters and buffers: the
    packed and quantized ones are buffers), each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "meta":
            continue
        if t.is_mkldnn:  # a oneDNN-packed weight (PackedLinear): opaque, no storage to ask
            total += t.numel() * t.element_size()
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
