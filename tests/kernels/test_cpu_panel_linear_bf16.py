"""The C++ bf16-weight panel linear (kernels/src/pagedserve/kernels/cpu/linear_bf16.cpp) and its packing, on every
ISA build (the `ext` fixture).

The reference is float64 over the same rounded operands the kernel multiplies: the weight
rounded to bf16, and x rounded to bf16 too where the build uses AVX-512 BF16 dot products
(`ext.bf16_dot_products`). What is left is fp32 accumulation (~1e-6 relative at these K).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import pack_panels_bf16, panel_linear_bf16


def reference(
    ext: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    xr = x.bfloat16() if ext.bf16_dot_products else x
    out = xr.double() @ weight.bfloat16().double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize(("out_features", "in_features"), [(32, 7), (100, 64), (1, 1)])
@pytest.mark.parametrize("width", [32, 16, 8])
def test_pack_panels_bf16_layout(out_features: int, in_features: int, width: int) -> None:
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, in_features) + 1
    packed = pack_panels_bf16(weight, width)
    panels, pairs = -(-out_features // width), -(-in_features // 2)
    assert packed.shape == (panels, pairs, width, 2) and packed.dtype == torch.bfloat16
    assert packed.is_contiguous()
    for n in range(panels * width):
        for k in range(pairs * 2):
            got = packed[n // width, k // 2, n % width, k % 2]
            want = (
                weight[n, k].bfloat16()
                if n < out_features and k < in_features
                else torch.tensor(0.0).bfloat16()
            )
            assert torch.equal(got, want), (n, k)


def test_pack_panels_bf16_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="pack_panels_bf16 needs a 2-D float32 CPU weight"):
        pack_panels_bf16(torch.zeros(4, 4, dtype=torch.bfloat16), 32)
    with pytest.raises(ValueError, match=r"pack_panels_bf16: width must be one of \(32, 16, 8\), got 4"):
        pack_panels_bf16(torch.zeros(4, 4), 4)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("in_features", [7, 64, 577])
@pytest.mark.parametrize("out_features", [100, 576])
@pytest.mark.parametrize("rows", [1, 6, 13, 34, 200])
def test_matches_float64_on_the_rounded_operands(
    ext: CpuKernels, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = panel_linear_bf16(ext, x, pack_panels_bf16(weight, ext.panel_width), out_features, b)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(ext, x, weight, b), rtol=1e-5, atol=2e-5)


def test_a_row_does_not_depend_on_the_batch(ext: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(100, 576, generator=gen) / 24
    packed = pack_panels_bf16(weight, ext.panel_width)
    batch = torch.randn(200, 576, generator=gen)
    full = panel_linear_bf16(ext, batch, packed, 100)
    for position in (0, 11, 12, 96, 199):
        alone = panel_linear_bf16(ext, batch[position : position + 1], packed, 100)
        assert torch.equal(alone[0], full[position])
    strided = torch.randn(200, 600, generator=gen)[:, :576]
    strided.copy_(batch)
    assert torch.equal(panel_linear_bf16(ext, strided, packed, 100), full)


def test_zero_rows_and_bad_inputs(ext: CpuKernels) -> None:
    weight = torch.randn(100, 64)
    packed = pack_panels_bf16(weight, ext.panel_width)
    assert panel_linear_bf16(ext, torch.empty(0, 64), packed, 100).shape == (0, 100)
    x, out = torch.randn(5, 64), torch.empty(5, 100)
    with pytest.raises(RuntimeError, match="panel_linear_bf16: packed must be a contiguous bfloat16"):
        ext.panel_linear_bf16(out, x, packed.float(), torch.empty(0))
    with pytest.raises(
        RuntimeError, match=r"x must be \[rows, in_features\] with in_features / 2 rounded up = 32"
    ):
        ext.panel_linear_bf16(out, torch.randn(5, 66), packed, torch.empty(0))
    with pytest.raises(RuntimeError, match="out, x and bias must be float32 CPU tensors"):
        ext.panel_linear_bf16(out, x.double(), packed, torch.empty(0))
    with pytest.raises(RuntimeError, match=r"bias must be empty or a contiguous \[100\]"):
        ext.panel_linear_bf16(out, x, packed, torch.ones(99))
    panels = packed.shape[0]
    with pytest.raises(RuntimeError, match=f"out has 1 columns but packed holds {panels} panels"):
        ext.panel_linear_bf16(torch.empty(5, 1), x, packed, torch.empty(0))
