"""Quantized weights kept quantized: the GGUF block decoders (kernels/src/pagedserve/kernels/gguf_blocks.py) against the
`gguf` package's de-quantizers, and the C++ quant_panel_linear (kernels/src/pagedserve/kernels/cpu/linear_quant.cpp)
against panel_linear over the de-quantized weight, on every ISA build this CPU runs.

In floats the kernel promises bit-identical results to the fp32 panel kernel on the
de-quantized weight (value * scale + min rounds once, as the reference does: see the C++
source), so those comparisons are torch.equal. By integer dot products (int8_activations) it
multiplies x rounded to int8 per block (`round_activations`, the same rounding bit for bit):
its result is float64 math on the rounded x up to float32 rounding, and its distance from the
exact result is bounded by the rounding alone (each x moves at most half its block's step).
Formats gguf cannot quantize (Q4_K, Q6_K) are tested on random blocks with finite float16
scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.gguf_blocks import BLOCKS, UnsupportedTensorType, decode_blocks
from pagedserve.kernels.linear import pack_panels, panel_linear
from pagedserve.kernels.quant import (
    QuantizedWeight,
    pack_quant_panels,
    quant_panel_linear,
    quantize_4bit,
    quantize_int8,
    round_activations,
)


def gguf_tensor(type_name: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [out_features, bytes per row] of a random weight in `type_name`."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32) * 0.05
        return quants.quantize(weight, qtype)
    block_bytes, block_weights = BLOCKS[type_name]
    blocks = rng.integers(0, 256, (out_features * in_features // block_weights, block_bytes), dtype=np.uint8)
    d = (rng.random((blocks.shape[0], 2), dtype=np.float32) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        blocks[:, 0:4] = d.reshape(-1, 4)  # d and dmin
    else:  # Q6_K: d is the block's last field
        blocks[:, 208:210] = d[:, :2]
    return blocks.reshape(out_features, -1)


@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_decoded_blocks_dequantize_to_ggufs_floats_exactly(type_name: str) -> None:
    out_features, in_features = 24, 512
    raw = gguf_tensor(type_name, out_features, in_features, seed=1)
    weight = decode_blocks("blk.0.ffn_up.weight", type_name, raw, out_features, in_features)
    expected = quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert weight.kind == type_name and weight.bits == (4 if type_name.startswith("Q4") else 8)
    assert weight.group == (16 if type_name == "Q6_K" else 32)
    assert torch.equal(
        weight.dequantize(), torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))
    )


def test_an_unsupported_type_is_refused_naming_the_tensor() -> None:
    with pytest.raises(UnsupportedTensorType, match=r"'blk.3.attn_q.weight' is Q5_K; supported .*Q4_1"):
        decode_blocks("blk.3.attn_q.weight", "Q5_K", np.zeros((4, 176), np.uint8), 4, 256)


def test_a_short_tensor_is_refused_with_its_sizes() -> None:
    raw = gguf_tensor("Q4_1", 4, 64, seed=2)
    with pytest.raises(ValueError, match=r"'output.weight': 140 bytes, but 4 x 64 Q4_1 needs 160"):
        decode_blocks("output.weight", "Q4_1", raw.reshape(-1)[:140], 4, 64)


def _chunk_columns(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """A group's packed values [steps / 4 chunks x lanes x 4 bytes] as [lanes, steps]: lane c's
    bytes at every k step of the group, in order."""
    return values.view(-1, lanes, 4).permute(1, 0, 2).reshape(lanes, -1)


@pytest.mark.parametrize("width", [32, 16, 8])
def test_4bit_panels_hold_each_group_s_values_in_4_step_lanes_then_its_scales_and_mins(width: int) -> None:
    values = torch.randint(0, 16, (2 * width + 3, 64), dtype=torch.uint8)
    scales, mins = torch.rand(values.shape[0], 2), torch.rand(values.shape[0], 2)
    panels = pack_quant_panels(QuantizedWeight(values, scales, mins, 32, "4bit"), width)
    half = width // 2
    group_bytes = 32 * half + 2 * width * 4
    assert panels.packed.dtype == torch.uint8 and panels.packed.shape == (3, 2, group_bytes)
    assert not panels.half_scales  # torch.rand's floats are not float16s
    for p in range(3):
        for g in range(2):
            group = panels.packed[p, g]
            lanes = _chunk_columns(group[: 32 * half], half)  # lane c: column c low, c + half high
            got_scales = group[32 * half : 32 * half + width * 4].view(torch.float32)
            got_mins = group[32 * half + width * 4 :].view(torch.float32)
            for j in range(width):
                col = p * width + j
                column = lanes[j] & 15 if j < half else lanes[j - half] >> 4
                real = col < values.shape[0]
                want = values[col, g * 32 : (g + 1) * 32] if real else torch.zeros(32, dtype=torch.uint8)
                assert torch.equal(column, want)
                assert got_scales[j] == (scales[col, g] if real else 0)  # padding columns weigh 0
                assert got_mins[j] == (mins[col, g] if real else 0)


def test_8bit_panels_hold_each_group_s_int8_values_in_4_step_lanes_then_its_scales() -> None:
    weight = quantize_int8(torch.randn(20, 64), 32)
    panels = pack_quant_panels(weight, 16)
    group_bytes = 32 * 16 + 16 * 4
    assert panels.packed.dtype == torch.int8 and panels.packed.shape == (2, 2, group_bytes)
    second = panels.packed[0, 1]
    assert torch.equal(_chunk_columns(second[: 32 * 16], 16)[3], weight.values[3, 32:])
    scales = panels.packed[1, 1, 32 * 16 :].view(torch.uint8).view(torch.float32)
    assert scales[3] == weight.scales[19, 1]  # panel 1 holds columns 16 .. 31
    assert torch.equal(scales[4:], torch.zeros(12))  # padding columns weigh 0


def test_scales_that_are_float16s_are_packed_as_float16() -> None:
    weight = quantize_4bit(torch.randn(16, 64))  # Q4_1's form: scales and mins float16s
    panels = pack_quant_panels(weight, 16)
    group_bytes = 32 * 8 + 2 * 16 * 2
    assert panels.half_scales and panels.packed.shape == (1, 2, group_bytes)
    group = panels.packed[0, 1]
    got_scales = group[32 * 8 : 32 * 8 + 32].view(torch.float16)
    got_mins = group[32 * 8 + 32 :].view(torch.float16)
    assert weight.mins is not None
    assert torch.equal(got_scales.float(), weight.scales[:, 1]) and torch.equal(
        got_mins.float(), weight.mins[:, 1]
    )
    int8 = pack_quant_panels(quantize_int8(torch.randn(16, 64), 32), 16)
    assert not int8.half_scales  # max |w| / 127 is rarely a float16


def test_a_group_not_a_multiple_of_4_steps_is_refused() -> None:
    with pytest.raises(ValueError, match=r"groups of a multiple of 4 inputs, got 6"):
        pack_quant_panels(quantize_int8(torch.randn(8, 12), 6), 8)


def weights(out_features: int, in_features: int) -> list[QuantizedWeight]:
    """Every form the kernel serves: each GGUF format, int8 per channel and per group, 4-bit."""
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    dense = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    forms = [quantize_int8(dense), quantize_int8(dense, 32), quantize_4bit(dense, 32)]
    for type_name, (_, block_weights) in sorted(BLOCKS.items()):
        if in_features % block_weights == 0:
            raw = gguf_tensor(type_name, out_features, in_features, seed=out_features)
            forms.append(decode_blocks("w", type_name, raw, out_features, in_features))
    return forms


@pytest.mark.parametrize(("out_features", "in_features"), [(100, 512), (576, 256), (40, 64)])
@pytest.mark.parametrize("rows", [1, 5, 13, 34])
def test_quant_linear_equals_the_fp32_panels_on_the_dequantized_weight(
    ext: CpuKernels, out_features: int, in_features: int, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for weight in weights(out_features, in_features):
        panels = pack_quant_panels(weight, ext.panel_width)
        fp32 = pack_panels(weight.dequantize(), ext.panel_width)
        for b in (None, bias):
            got = quant_panel_linear(ext, x, panels, b)
            assert torch.equal(got, panel_linear(ext, x, fp32, out_features, b)), (
                weight.kind,
                weight.group,
                b is None,
            )
        # and close to float64 math on the de-quantized weight
        expected = x.double() @ weight.dequantize().double().T
        torch.testing.assert_close(got.double() - bias.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_batch(ext: CpuKernels) -> None:
    weight = weights(96, 256)[-1]
    panels = pack_quant_panels(weight, ext.panel_width)
    x = torch.randn(40, 256)
    batched = quant_panel_linear(ext, x, panels)
    for i in (0, 17, 39):
        assert torch.equal(quant_panel_linear(ext, x[i : i + 1], panels)[0], batched[i])


def test_the_op_refuses_a_panel_that_is_not_values_and_whole_groups(ext: CpuKernels) -> None:
    panels = pack_quant_panels(quantize_4bit(torch.randn(32, 64)), ext.panel_width)
    out = torch.empty(2, 32)
    short = panels.packed[:, :, :-4].contiguous()
    with pytest.raises(
        RuntimeError,
        match=r"2 groups of .* bytes are not 64 inputs of 4-bit values .* float16 or float32 scales and mins",
    ):
        ext.quant_panel_linear(out, torch.randn(2, 64), short, torch.empty(0))
    with pytest.raises(RuntimeError, match=r"are not 65 inputs"):
        ext.quant_panel_linear(out, torch.randn(2, 65), panels.packed, torch.empty(0))
    with pytest.raises(
        RuntimeError, match=r"packed must be a contiguous uint8 \(4-bit\) or int8 \(8-bit\) \[panels, groups"
    ):
        ext.quant_panel_linear(out, torch.randn(2, 64), panels.packed.flatten(1), torch.empty(0))


@pytest.mark.parametrize(("out_features", "in_features"), [(100, 512), (576, 256), (40, 64)])
@pytest.mark.parametrize("rows", [1, 5, 13, 34])
def test_int8_activations_multiply_x_rounded_per_block_and_stay_within_its_bound(
    ext: CpuKernels, out_features: int, in_features: int, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows + 100)
    x = torch.randn(rows, in_features, generator=gen)
    x[0, :7] = 0.0  # a block partly zero, and below a whole zero block
    if in_features >= 64:
        x[-1, 32:64] = 0.0
    bias = torch.randn(out_features, generator=gen)
    for weight in weights(out_features, in_features):
        panels = pack_quant_panels(weight, ext.panel_width)
        got = quant_panel_linear(ext, x, panels, bias, int8_activations=True)
        dense = weight.dequantize().double()
        rounded, scales = round_activations(x, weight.group)
        what = (weight.kind, weight.group)
        # the kernel's arithmetic: x rounded, then exact sums up to float32 rounding
        torch.testing.assert_close(
            got.double(), rounded.double() @ dense.T + bias.double(), rtol=1e-5, atol=1e-4
        )
        # the bound: |x - rounded| <= step / 2 per input, so each output moves at most
        # sum over k of |w[o, k]| * step(k) / 2 from the exact x @ w.T (plus float32 slack)
        step = scales.double().repeat_interleave(in_features // scales.shape[1], dim=1)
        bound = dense.abs() @ (step / 2).T  # [out, rows]
        error = (got.double() - bias.double() - x.double() @ dense.T).abs()
        assert bool((error <= bound.T * (1 + 1e-6) + 1e-4).all()), what
        assert float(error.max()) > 0, what  # it did round


def test_int8_activations_do_not_depend_on_the_batch(ext: CpuKernels) -> None:
    x = torch.randn(40, 256)
    for weight in weights(96, 256):
        panels = pack_quant_panels(weight, ext.panel_width)
        batched = quant_panel_linear(ext, x, panels, int8_activations=True)
        for i in (0, 17, 39):
            alone = quant_panel_linear(ext, x[i : i + 1], panels, int8_activations=True)[0]
            assert torch.equal(alone, batched[i]), weight.kind


def test_a_group_no_activation_block_fits_is_multiplied_in_floats(ext: CpuKernels) -> None:
    weight = quantize_int8(torch.randn(24, 36))  # one group of 36 inputs: neither <= 32 nor 32 k
    panels = pack_quant_panels(weight, ext.panel_width)
    x = torch.randn(3, 36)
    assert torch.equal(
        quant_panel_linear(ext, x, panels, int8_activations=True), quant_panel_linear(ext, x, panels)
    )
