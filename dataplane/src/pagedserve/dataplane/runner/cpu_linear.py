"""Prepacked fp32 linear layers for CPU inference, applied to a built model as a transform.

Why: at the row counts of decode steps (tens of rows) MKL's sgemm on a plain [out, in]
weight reaches well under half of the machine's peak. Two packings, each reordering the
weight once at load:
- `PanelLinear`: our C++ kernel (kernels/src/pagedserve/kernels/cpu/linear.cpp) on weights packed into column
  panels of the build's ISA. Measured on the default model's shapes at 2 threads (AVX-512):
  1.2-1.6x oneDNN's packed linear at 8-34 rows, and batch-invariant.
- `PackedLinear`: oneDNN's blocked layout (1.4x MKL on the layer matmuls, 2x on the
  576x49152 LM head).
Which one serves each shape is chosen at load (linear_selection.py). Results differ from
`F.linear` only in accumulation order (~1e-6 relative in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.dataplane.runner.linear_selection import ShapeChoice
from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import NO_BIAS, pack_panels, pack_panels_bf16, panel_linear, panel_linear_bf16


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `model`'s submodule `name` ("model.layers.3.mlp.up_proj") is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def rows_of(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in_features] as the [rows, in_features] the C++ linear ops take (a contiguous
    last dim; a view where it already is one)."""
    flat = x.reshape(-1, in_features)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def onednn_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """Inference-only replacement of an nn.Linear; the weight is reordered once at load."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False
        )
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn_packed=True"


class PanelLinear(nn.Module):
    """Inference-only replacement of an fp32 CPU nn.Linear; the weight is packed into
    pagedserve.kernels.linear's column panels once, and the C++ panel_linear op computes it. With
    `bf16_weights` the panels hold the weight rounded to bfloat16 (half the bytes) and
    panel_linear_bf16 computes it; x and the result stay float32."""

    def __init__(self, linear: nn.Linear, ops: CpuKernels, bf16_weights: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._ops = ops
        self.bf16_weights = bf16_weights
        self.panels: torch.Tensor
        pack = pack_panels_bf16 if bf16_weights else pack_panels
        self.register_buffer("panels", pack(linear.weight.detach(), ops.panel_width), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def kernel_bias(self) -> torch.Tensor:
        """The bias as the C++ ops take it: the tensor, or pagedserve.kernels.linear.NO_BIAS for none."""
        return NO_BIAS if self.bias is None else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = rows_of(x, self.in_features)
        linear = panel_linear_bf16 if self.bf16_weights else panel_linear
        out = linear(self._ops, flat, self.panels, self.out_features, self.kernel_bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        weights = "bfloat16" if self.bf16_weights else "float32"
        return f"in_features={self.in_features}, out_features={self.out_features}, panels={weights}"


def packed_linear(
    linear: nn.Linear, panel_ops: CpuKernels | None, choice: ShapeChoice | None, bf16_weights: bool = False
) -> PanelLinear | PackedLinear:
    """The replacement of one linear: oneDNN's where the choice says so (or there are no C++
    kernels), else a PanelLinear."""
    if panel_ops is None or (choice is not None and choice.choice == "onednn"):
        return PackedLinear(linear)
    return PanelLinear(linear, panel_ops, bf16_weights)


def pack_linears(
    model: nn.Module,
    panel_ops: CpuKernels | None = None,
    choices: dict[tuple[int, int], ShapeChoice] | None = None,
    bf16_weights: bool = False,
) -> int:
    """Replace every nn.Linear of `model` in place: by oneDNN's PackedLinear without the C++
    kernels, else as `choices` (linear_selection.select_linears, by (in, out) shape) says,
    PanelLinear for shapes it does not name; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        choice = None if choices is None else choices.get((linear.in_features, linear.out_features))
        replace_module(model, name, packed_linear(linear, panel_ops, choice, bf16_weights))
    return len(targets)
