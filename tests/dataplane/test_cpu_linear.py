"""The prepacked-linear transforms (oneDNN's PackedLinear, the C++ kernel's PanelLinear):
same function, every Linear replaced. PanelLinear needs the C++ extension to build here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.dataplane.runner.cpu_linear import (
    PackedLinear,
    PanelLinear,
    onednn_linear_available,
    pack_linears,
)
from pagedserve.dataplane.runner.quant_linear import weight_bytes
from pagedserve.kernels.cpu_ext import CpuKernels, load_cpu_kernels


@pytest.fixture(scope="module")
def ext() -> CpuKernels:
    kernels = load_cpu_kernels(strict=True)
    assert kernels is not None
    return kernels


def test_packed_linear_matches_f_linear() -> None:
    torch.manual_seed(0)
    for bias in (False, True):
        linear = nn.Linear(96, 200, bias=bias)
        packed = PackedLinear(linear)
        for rows in (1, 7, 64):
            x = torch.randn(2, rows, 96)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
            assert packed(x).shape == (2, rows, 200)


def test_pack_linears_replaces_every_linear_in_place() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 2)))
    x = torch.randn(3, 8)
    expected = model(x)
    assert pack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 3
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_weight_bytes_counts_onednn_packed_weights_too() -> None:
    """A oneDNN-packed weight is an opaque tensor without a storage to ask: counted by its
    elements (the engine's start-up log once failed on it where oneDNN won a shape)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4, bias=False))
    assert weight_bytes(model) == (8 * 16 + 16 + 16 * 4) * 4
    pack_linears(model)
    assert weight_bytes(model) == (8 * 16 + 16 + 16 * 4) * 4


def test_only_fp32_cpu_is_packed() -> None:
    assert onednn_linear_available(torch.float32, torch.device("cpu")) == torch.backends.mkldnn.is_available()
    assert not onednn_linear_available(torch.bfloat16, torch.device("cpu"))
    assert not onednn_linear_available(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("out_features", [64, 100])  # 100: a ragged last panel
def test_panel_linear_matches_nn_linear(ext: CpuKernels, out_features: int, bias: bool) -> None:
    torch.manual_seed(out_features)
    linear = nn.Linear(96, out_features, bias=bias)
    panel = PanelLinear(linear, ext)
    assert (panel.bias is None) == (not bias)
    x = torch.randn(2, 5, 96)
    with torch.no_grad():
        want = linear(x)
    got = panel(x)
    assert got.shape == (2, 5, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A view whose last dim is not contiguous is copied, not refused.
    x_t = torch.randn(96, 5, 2).permute(2, 1, 0)
    with torch.no_grad():
        want_t = linear(x_t)
    torch.testing.assert_close(panel(x_t), want_t, rtol=1e-5, atol=1e-5)


def test_pack_linears_with_panel_ops_uses_panel_linear(ext: CpuKernels) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(8, 40), nn.ReLU(), nn.Sequential(nn.Linear(40, 4, bias=False), nn.Linear(4, 2))
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    assert pack_linears(model, panel_ops=ext) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert sum(isinstance(m, PanelLinear) for m in model.modules()) == 3
    assert isinstance(model[0], PanelLinear) and (model[0].in_features, model[0].out_features) == (8, 40)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
