"""Quantized linear weights kept quantized in memory, for the C++ op in kernels/src/pagedserve/kernels/cpu/linear_quant.cpp.

One form serves every format we load (GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: kernels/src/pagedserve/kernels/gguf_blocks.py;
`--quantization int8`: `quantize_int8`): a weight [out, in] is integer values, one per weight,
and per (output row, group of `group` inputs) a float32 scale and, for the asymmetric
formats, a float32 min:

    weight[o, i] = values[o, i] * scales[o, i // group] (+ mins[o, i // group])

`dequantize` computes exactly that in float32 (the product first, then the min: one rounding
each, and the product is exact for every format with a min, so it equals the fused
multiply-add the kernel uses). `pack_quant_panels` reorders a weight once, at load, into the
column panels of the build's ISA (the fp32 panels' order, kernels/src/pagedserve/kernels/linear.py), 4-bit values two
to a byte, each panel's groups one after the other in one row of bytes (a group's values, then
its scales and mins); `quant_panel_linear` computes x @ weight.T + bias from them: in floats, bit-identical to
`panel_linear` over the de-quantized weight, or by integer dot products over x rounded to int8
per block (`round_activations`), as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import NO_BIAS, PANEL_WIDTHS


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [out, in] as integer values with per-group scales (and mins)."""

    values: torch.Tensor  # [out, in]: int8 (8-bit, signed) or uint8 (4-bit, 0 .. 15)
    scales: torch.Tensor  # [out, in // group] float32
    mins: torch.Tensor | None  # [out, in // group] float32, or None (symmetric)
    group: int  # inputs per scale
    kind: str  # the source format, for logs: "Q4_1", "Q8_0", "int8", ...

    def __post_init__(self) -> None:
        out_features, in_features = self.values.shape
        if self.values.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"{self.kind}: values must be int8 or uint8, got {self.values.dtype}")
        if self.group <= 0 or in_features % self.group:
            raise ValueError(f"{self.kind}: group {self.group} does not divide in_features {in_features}")
        expected = (out_features, in_features // self.group)
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (tuple(t.shape) != expected or t.dtype != torch.float32):
                raise ValueError(
                    f"{self.kind}: {name} must be float32 {expected}, got {tuple(t.shape)} {t.dtype}"
                )
        if self.values.dtype == torch.uint8 and self.mins is None:
            raise ValueError(f"{self.kind}: 4-bit values (0 .. 15) need mins")

    @property
    def bits(self) -> int:
        return 4 if self.values.dtype == torch.uint8 else 8

    @property
    def out_features(self) -> int:
        return int(self.values.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.values.shape[1])

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [out, in] (the reference the kernel equals), or only its `rows`
        (an index tensor: an embedding's looked-up tokens)."""
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        weight = pick(self.values).to(torch.float32) * pick(self.scales).repeat_interleave(self.group, dim=1)
        if self.mins is not None:
            weight = weight + pick(self.mins).repeat_interleave(self.group, dim=1)
        return weight

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the output rows `index` (a permutation, a shard's slice)."""
        return QuantizedWeight(
            self.values[index].contiguous(),
            self.scales[index].contiguous(),
            None if self.mins is None else self.mins[index].contiguous(),
            self.group,
            self.kind,
        )

    @staticmethod
    def concat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The weights' output rows stacked (fused projections); they must share a form."""
        first = weights[0]
        forms = {(w.values.dtype, w.group, w.mins is None, w.in_features) for w in weights}
        if len(forms) != 1:
            raise ValueError(f"cannot stack quantized weights of different forms: {sorted(map(str, forms))}")
        kinds = sorted({w.kind for w in weights})
        return QuantizedWeight(
            torch.cat([w.values for w in weights]),
            torch.cat([w.scales for w in weights]),
            None if first.mins is None else torch.cat([w.mins for w in weights if w.mins is not None]),
            first.group,
            "+".join(kinds),
        )


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """Symmetric int8 per output row and `group` inputs (None: the whole row, per channel):
    scale = max |w| / 127, value = round(w / scale)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8 needs a 2-D weight, got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    group = in_features if group is None else group
    if in_features % group:
        raise ValueError(f"quantize_int8: group {group} does not divide in_features {in_features}")
    blocks = weight.detach().to(torch.float32).reshape(out_features, in_features // group, group)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    values = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(
        values.reshape(out_features, in_features), scales.contiguous(), None, group, "int8"
    )


def quantize_4bit(weight: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Asymmetric 4-bit per `group` inputs (the Q4_1 form): min = the group's min, scale =
    (max - min) / 15, both rounded to float16 as Q4_1 stores them (so value * scale is exact
    in float32, the kernel's condition for a min), value = round((w - min) / scale). For tests
    and test data."""
    out_features, in_features = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(out_features, in_features // group, group)
    lo = blocks.amin(dim=-1).to(torch.float16).to(torch.float32)
    scales = ((blocks.amax(dim=-1) - lo) / 15.0).to(torch.float16).to(torch.float32)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    values = torch.round((blocks - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(values.reshape(out_features, in_features), scales, lo.contiguous(), group, "4bit")


@dataclass(frozen=True)
class QuantPanels:
    """A QuantizedWeight in the column panels of one ISA build: per panel and group its values,
    then its scales (and mins), float16 where every one of them is a float16 exactly (GGUF
    Q8_0 / Q4_0 / Q4_1 store theirs so), else float32 (layout: kernels/src/pagedserve/kernels/cpu/linear_quant.cpp)."""

    packed: torch.Tensor  # uint8 (4-bit values, with mins) or int8 (8-bit values) [P, G, bytes]
    out_features: int
    half_scales: bool

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _exactly_half(t: torch.Tensor | None) -> bool:
    """Whether every value of `t` (None: vacuously) survives a round trip through float16."""
    return t is None or bool(torch.equal(t.to(torch.float16).to(torch.float32), t))


def _panels(t: torch.Tensor, width: int) -> torch.Tensor:
    """[out, cols] -> [ceil(out / width), cols, width], zero-padded output rows."""
    out_features, cols = t.shape
    panels = -(-out_features // width)
    padded = t.new_zeros(panels * width, cols)
    padded[:out_features] = t
    return padded.view(panels, width, cols).transpose(1, 2).contiguous()


# k steps per chunk of a packed group: a 32-bit lane holds one column's values at 4 steps.
CHUNK_STEPS = 4


def pack_quant_panels(weight: QuantizedWeight, width: int) -> QuantPanels:
    """Reorder `weight` into panels of `width` output columns (the build's panel_width); its
    group must be a multiple of CHUNK_STEPS."""
    if width not in PANEL_WIDTHS:
        raise ValueError(f"pack_quant_panels: width must be one of {PANEL_WIDTHS}, got {width}")
    if weight.bits == 8 and weight.mins is not None:
        raise ValueError(f"{weight.kind}: the kernel takes 8-bit values without mins only")
    if weight.group % CHUNK_STEPS:
        raise ValueError(
            f"{weight.kind}: the kernel takes groups of a multiple of {CHUNK_STEPS} inputs, got {weight.group}"
        )
    values = _panels(weight.values, width)  # [P, K, W]
    panels, k_len = values.shape[0], values.shape[1]
    # Chunks of 4 k steps, one lane of 4 bytes per column: [P, K / 4, W, 4].
    values = values.view(panels, k_len // CHUNK_STEPS, CHUNK_STEPS, width).transpose(2, 3)
    if weight.bits == 4:
        half = width // 2
        values = values[:, :, :half] | (values[:, :, half:] << 4)
    groups = weight.in_features // weight.group
    # Scales (and mins) in float16 where that loses nothing: a 4-bit weight's bytes then drop
    # from 0.75 to 0.625 per weight, an 8-bit one's from 1.125 to 1.0625 (memory bandwidth is
    # what bounds a decode step).
    half = _exactly_half(weight.scales) and _exactly_half(weight.mins)
    scale_dtype = torch.float16 if half else torch.float32
    # Per group: its values, then its scales (and mins), so a panel is read front to back.
    parts = [
        values.contiguous().view(torch.uint8).reshape(panels, groups, -1),
        _panels(weight.scales.to(scale_dtype), width),
    ]
    if weight.mins is not None:
        parts.append(_panels(weight.mins.to(scale_dtype), width))
    packed = torch.cat(
        [part.contiguous().view(torch.uint8).reshape(panels, groups, -1) for part in parts], dim=2
    )
    return QuantPanels(packed if weight.bits == 4 else packed.view(torch.int8), weight.out_features, half)


def activation_block(group: int) -> int:
    """Inputs per activation scale of the integer dot products for a weight of `group` inputs
    per scale: the group where it is at most 32, else 32 where that divides it (llama.cpp's Q8
    block); 0 where neither (the kernel then multiplies in floats). Mirrors panel_quant.h."""
    if group % CHUNK_STEPS:
        return 0
    if group <= 32:
        return group
    return 32 if group % 32 == 0 else 0


def round_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 as the integer dot products multiply it for a weight of `group`
    inputs per scale: each block's values rounded (ties to even) to steps of scale = its max
    |x| / 127, back in float32; and the scales [rows, in / block]. The kernel's own rounding,
    bit for bit (the reference its tests compare with)."""
    block = activation_block(group)
    if block == 0:
        raise ValueError(f"a weight of {group} inputs per scale is multiplied in floats")
    rows, k_len = x.shape
    blocks = x.reshape(rows, k_len // block, block)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    steps = torch.round(blocks * inverse).clamp_(-127, 127)
    return (steps * scales).reshape(rows, k_len), scales.squeeze(-1)


def quant_panel_linear(
    ops: CpuKernels,
    x: torch.Tensor,
    panels: QuantPanels,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [rows, in] float32 (last dim contiguous) @ the weight.T (+ bias) -> [rows, out];
    int8_activations: by integer dot products over x rounded to int8 per block
    (`int8_rows`), else in floats."""
    out = x.new_empty(x.shape[0], panels.out_features)
    ops.quant_panel_linear(out, x, panels.packed, NO_BIAS if bias is None else bias, int8_activations)
    return out
