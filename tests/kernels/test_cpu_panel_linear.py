"""The C++ panel-packed fp32 linear kernel (kernels/src/pagedserve/kernels/cpu/linear.cpp) and its packing
(kernels/src/pagedserve/kernels/linear.py) against a float64 x @ w.T + b.

The extension must build here (load_cpu_kernels(strict=True)). Beyond accuracy, the kernel
promises bit-identical rows whatever the batch, the row's position in it, the row stride of x
and the thread count: asserted with torch.equal. Shapes cover a ragged last panel (100
columns), the row tiles (6 or 12 rows by ISA: a full first tile, the rest balanced) and the 96-row chunks of long prefills.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import PANEL_WIDTHS, pack_panels, panel_linear


def make_layer(
    out_features: int, in_features: int, seed: int, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight and bias scaled so outputs are of order 1 whatever in_features is."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    return weight, b


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


# --- pack_panels -------------------------------------------------------------------------


@pytest.mark.parametrize("width", PANEL_WIDTHS)
@pytest.mark.parametrize("out_features", [32, 100, 1])
def test_pack_panels_layout(out_features: int, width: int) -> None:
    in_features = 7
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, in_features) + 1
    packed = pack_panels(weight, width)
    panels = -(-out_features // width)
    assert packed.shape == (panels, in_features, width)
    assert packed.dtype == torch.float32 and packed.is_contiguous()
    for p in range(panels):
        for j in range(width):
            n = p * width + j
            column = packed[p, :, j]
            if n < out_features:
                assert torch.equal(column, weight[n])
            else:
                # Padding must be exact zeros: the kernel multiplies it in before dropping it.
                assert torch.equal(column, torch.zeros(in_features))
    # Every weight value appears once; the rest is padding (all values are >= 1).
    assert int((packed != 0).sum()) == out_features * in_features


def test_pack_panels_spot_values() -> None:
    weight, _ = make_layer(100, 64, seed=1)
    packed = pack_panels(weight, 32)
    assert packed.shape == (4, 64, 32)
    assert packed[0, 0, 0].item() == weight[0, 0].item()
    assert packed[1, 5, 3].item() == weight[35, 5].item()
    assert packed[3, 63, 3].item() == weight[99, 63].item()
    assert packed[3, 63, 4].item() == 0.0
    assert torch.equal(packed[3, :, 4:], torch.zeros(64, 28))


@pytest.mark.parametrize(
    "weight",
    [
        torch.zeros(4, 5, 6),
        torch.zeros(8),
        torch.zeros(8, 4, dtype=torch.float64),
        torch.zeros(8, 4, dtype=torch.bfloat16),
    ],
    ids=["3d", "1d", "float64", "bfloat16"],
)
def test_pack_panels_refuses_bad_weights(weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="pack_panels needs a 2-D float32 CPU weight"):
        pack_panels(weight, 32)


def test_pack_panels_refuses_other_widths() -> None:
    with pytest.raises(ValueError, match=r"pack_panels: width must be one of \(32, 16, 8\), got 24"):
        pack_panels(torch.zeros(8, 4), 24)


# --- accuracy --------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("in_features", [7, 64, 576])
@pytest.mark.parametrize("out_features", [32, 100, 576])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 11, 12, 13, 34, 97, 200])
def test_panel_linear_matches_float64(
    ext: CpuKernels, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    weight, b = make_layer(out_features, in_features, seed=rows * 7 + out_features + in_features, bias=bias)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = panel_linear(ext, x, pack_panels(weight, ext.panel_width), out_features, b)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, weight, b), rtol=1e-5, atol=1e-5)


def test_panel_linear_exact_on_small_integers(ext: CpuKernels) -> None:
    # Small integers make every product and partial sum exact in float32, so the result
    # must equal the integer matmul bit for bit whatever the accumulation order.
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (13, 40), generator=gen).float()
    weight = torch.randint(-4, 5, (70, 40), generator=gen).float()
    b = torch.randint(-100, 101, (70,), generator=gen).float()
    out = panel_linear(ext, x, pack_panels(weight, ext.panel_width), 70, b)
    want = (x.long() @ weight.long().T + b.long()).float()
    assert torch.equal(out, want)


# --- invariances ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [2, 34, 200])  # one row would count as contiguous
def test_row_stride_is_bit_identical(ext: CpuKernels, rows: int) -> None:
    weight, b = make_layer(100, 576, seed=5)
    packed = pack_panels(weight, ext.panel_width)
    wide = torch.randn(rows, 576 + 40, generator=torch.Generator().manual_seed(rows))
    x = wide[:, 17 : 17 + 576]
    assert x.stride() == (616, 1) and not x.is_contiguous()
    strided = panel_linear(ext, x, packed, 100, b)
    assert torch.equal(strided, panel_linear(ext, x.contiguous(), packed, 100, b))


@pytest.mark.parametrize("batch", [34, 200])
@pytest.mark.parametrize("out_features", [100, 576])
def test_rows_are_batch_invariant(ext: CpuKernels, batch: int, out_features: int) -> None:
    weight, b = make_layer(out_features, 576, seed=out_features)
    packed = pack_panels(weight, ext.panel_width)
    x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(batch))
    together = panel_linear(ext, x, packed, out_features, b)
    for i in range(batch):
        alone = panel_linear(ext, x[i : i + 1], packed, out_features, b)
        assert torch.equal(together[i : i + 1], alone), f"row {i} of {batch} differs from the row alone"


def test_same_row_at_any_position(ext: CpuKernels) -> None:
    # One row placed at the first, middle and last slots of tiles and 96-row chunks.
    weight, b = make_layer(576, 576, seed=9)
    packed = pack_panels(weight, ext.panel_width)
    gen = torch.Generator().manual_seed(9)
    row = torch.randn(1, 576, generator=gen)
    alone = panel_linear(ext, row, packed, 576, b)
    for batch, positions in ((34, (0, 11, 12, 22, 33)), (200, (0, 66, 67, 95, 96, 133, 134, 199))):
        x = torch.randn(batch, 576, generator=gen)
        for pos in positions:
            x_at = x.clone()
            x_at[pos] = row[0]
            out = panel_linear(ext, x_at, packed, 576, b)
            assert torch.equal(out[pos : pos + 1], alone), f"row at {pos} of {batch}"


def test_thread_count_invariant(ext: CpuKernels) -> None:
    weight, b = make_layer(576, 576, seed=11)
    packed = pack_panels(weight, ext.panel_width)
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(11))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panel_linear(ext, x, packed, 576, b)
        torch.set_num_threads(2)
        two = panel_linear(ext, x, packed, 576, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_zero_rows(ext: CpuKernels) -> None:
    weight, b = make_layer(100, 64, seed=2)
    out = panel_linear(ext, torch.empty(0, 64), pack_panels(weight, ext.panel_width), 100, b)
    assert out.shape == (0, 100) and out.dtype == torch.float32


# --- bad inputs -----------------------------------------------------------------------


def test_bad_inputs_are_refused(ext: CpuKernels) -> None:
    weight, b = make_layer(100, 64, seed=4)
    width = ext.panel_width
    packed = pack_panels(weight, width)  # columns 100 .. panels * width - 1 are padding
    panels = packed.shape[0]
    assert b is not None
    x = torch.randn(5, 64)
    out = torch.empty(5, 100)
    with pytest.raises(
        RuntimeError, match=rf"packed must be a contiguous \[panels, in_features, {width}\] weight"
    ):
        ext.panel_linear(out, x, packed[:, :, : width // 2].contiguous(), b)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\] with a contiguous last dim"):
        ext.panel_linear(out, torch.randn(5, 65), packed, b)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\] with a contiguous last dim"):
        ext.panel_linear(out, torch.randn(64, 5).T, packed, b)
    too_few, too_many = (panels - 1) * width, panels * width + 1
    with pytest.raises(
        RuntimeError, match=f"out has {too_few} columns but packed holds {panels} panels of {width}"
    ):
        ext.panel_linear(torch.empty(5, too_few), x, packed, torch.empty(0))
    with pytest.raises(
        RuntimeError, match=f"out has {too_many} columns but packed holds {panels} panels of {width}"
    ):
        ext.panel_linear(torch.empty(5, too_many), x, packed, torch.empty(0))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[5, out_features\] tensor"):
        ext.panel_linear(torch.empty(4, 100), x, packed, b)
    with pytest.raises(RuntimeError, match="out, x, packed and bias must be float32 CPU tensors"):
        ext.panel_linear(out, x.double(), packed, b)
    with pytest.raises(RuntimeError, match=r"bias must be empty or a contiguous \[100\]"):
        ext.panel_linear(out, x, packed, b[:99].contiguous())
    with pytest.raises(RuntimeError, match=r"bias must be empty or a contiguous \[100\]"):
        ext.panel_linear(out, x, packed, torch.randn(101))
