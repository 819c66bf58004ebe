"""fp32 CPU linear layers on panel-packed weights (the C++ op in kernels/cpu/linear.cpp).

`pack_panels` reorders an nn.Linear weight [out, in] once, at load, into panels of
PANEL_WIDTH output columns, each [in, PANEL_WIDTH] contiguous; `panel_linear` computes
x @ weight.T + bias from it. Why, and how it compares with oneDNN: the comment atop the C++
source. Each output element is one in-order FMA chain over the inputs, so a row's result does
not depend on the other rows of the batch or the thread count.
"""

from __future__ import annotations

import torch

from kernels.cpu_ext import CpuKernels

# Output columns per panel; kernels/cpu/linear.cpp's kPanel (it checks packed.size(2)).
PANEL_WIDTH = 32

# What the C++ ops take for "no bias".
NO_BIAS = torch.empty(0)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> [ceil(out / PANEL_WIDTH), in, PANEL_WIDTH], zero-padded columns."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"pack_panels needs a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL_WIDTH)
    padded = weight.new_zeros(panels * PANEL_WIDTH, in_features)
    padded[:out_features] = weight
    return padded.view(panels, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


def panel_linear(
    ops: CpuKernels,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] (last dim contiguous) @ weight.T (+ bias) -> a new [rows, out_features]."""
    out = x.new_empty(x.shape[0], out_features)
    ops.panel_linear(out, x, packed, NO_BIAS if bias is None else bias)
    return out
