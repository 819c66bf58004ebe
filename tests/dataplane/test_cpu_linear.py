"""The oneDNN prepacked-linear transform: same function, every Linear replaced."""

from __future__ import annotations

import torch
from torch import nn

from dataplane.runner.cpu_linear import PackedLinear, onednn_linear_available, pack_linears


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


def test_only_fp32_cpu_is_packed() -> None:
    assert onednn_linear_available(torch.float32, torch.device("cpu")) == torch.backends.mkldnn.is_available()
    assert not onednn_linear_available(torch.bfloat16, torch.device("cpu"))
    assert not onednn_linear_available(torch.float32, torch.device("cuda"))
