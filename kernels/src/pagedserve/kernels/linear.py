"""fp32 CPU linear layers on panel-packed weights (the C++ op in kernels/src/pagedserve/kernels/cpu/linear.cpp).

`pack_panels` reorders an nn.Linear weight [out, in] once, at load, into panels of `width`
output columns, each [in, width] contiguous, where width is the build's
`CpuKernels.panel_width` (two native vectors: 32 on AVX-512, 16 on AVX2, 8 on SSE2 / NEON;
kernels/src/pagedserve/kernels/cpu/panel.h); `panel_linear` computes
x @ weight.T + bias from it. Why, and how it compares with oneDNN: the comment atop the C++
source. Each output element is one in-order FMA chain over the inputs, so a row's result does
not depend on the other rows of the batch or the thread count.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_ext import CpuKernels

# The panel widths of the builds (kernels/src/pagedserve/kernels/cpu/panel.h kPanel; the op checks packed.size(2)).
PANEL_WIDTHS = (32, 16, 8)

# What the C++ ops take for "no bias".
NO_BIAS = torch.empty(0)


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[out, in] float32 -> [ceil(out / width), in, width], zero-padded columns."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"pack_panels needs a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    if width not in PANEL_WIDTHS:
        raise ValueError(f"pack_panels: width must be one of {PANEL_WIDTHS}, got {width}")
    out_features, in_features = weight.shape
    panels = -(-out_features // width)
    padded = weight.new_zeros(panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(panels, width, in_features).transpose(1, 2).contiguous()


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


def pack_panels_bf16(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[out, in] float32 -> bfloat16 [ceil(out / width), ceil(in / 2), width, 2]: panels of
    `width` columns whose (k pair, column) entries hold the column's weights at inputs 2j and
    2j + 1 (kernels/src/pagedserve/kernels/cpu/linear_bf16.cpp), rounded to nearest even; padding is zero."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"pack_panels_bf16 needs a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    if width not in PANEL_WIDTHS:
        raise ValueError(f"pack_panels_bf16: width must be one of {PANEL_WIDTHS}, got {width}")
    out_features, in_features = weight.shape
    panels, pairs = -(-out_features // width), -(-in_features // 2)
    padded = weight.new_zeros(panels * width, pairs * 2)
    padded[:out_features, :in_features] = weight
    # [P, W, pairs, 2] -> [P, pairs, W, 2]
    return padded.view(panels, width, pairs, 2).permute(0, 2, 1, 3).to(torch.bfloat16).contiguous()


def panel_linear_bf16(
    ops: CpuKernels,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] float32 (last dim contiguous) @ the bf16 weight.T (+ bias) -> float32."""
    out = x.new_empty(x.shape[0], out_features)
    ops.panel_linear_bf16(out, x, packed, NO_BIAS if bias is None else bias)
    return out
