"""The C++ decoder-layer halves (kernels/src/pagedserve/kernels/cpu/decoder_block.cpp) against the same steps as
separate ops (rms_norm, panel_linear, rotary_neox, add_rms_norm, silu_and_mul and torch's
in-place add): bit-identical, on shapes with ragged panels (out features not a multiple of
32), biases or none, the row tiles and the 96-row chunks of long prefills; and against a
float64 reference of the whole half; with fp32 and with bf16 weight panels (the bf16
reference uses the bf16-rounded weights, and tolerates the rounding of x that AVX-512 BF16
builds add). Bad inputs are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_ext import CpuKernels
from pagedserve.kernels.linear import NO_BIAS, pack_panels, pack_panels_bf16, panel_linear, panel_linear_bf16

HIDDEN = 80
HEADS, KV_HEADS, HEAD_DIM = 5, 1, 16
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM  # 112: three and a half panels
INTER = 72  # gate/up 144 columns: four and a half panels
EPS = 1e-6


def linear(
    out_features: int, in_features: int, gen: torch.Generator, bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    return weight, torch.randn(out_features, generator=gen) if bias else None


WEIGHTS = ["float32", "bfloat16"]


def pack(ext: CpuKernels, weight: torch.Tensor, weights: str) -> torch.Tensor:
    return (pack_panels_bf16 if weights == "bfloat16" else pack_panels)(weight, ext.panel_width)


def packed(
    ext: CpuKernels, layer: tuple[torch.Tensor, torch.Tensor | None], weights: str
) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = layer
    return pack(ext, weight, weights), NO_BIAS if bias is None else bias


def separate_linear(
    ext: CpuKernels, x: torch.Tensor, layer: tuple[torch.Tensor, torch.Tensor | None], weights: str
) -> torch.Tensor:
    """The separate op of this weight dtype (panel_linear or panel_linear_bf16)."""
    op = panel_linear_bf16 if weights == "bfloat16" else panel_linear
    return op(ext, x, pack(ext, layer[0], weights), layer[0].shape[0], layer[1])


def as_packed(
    layer: tuple[torch.Tensor, torch.Tensor | None], weights: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer as its panels hold it (bf16-rounded weights for bf16 panels), for the references."""
    weight, bias = layer
    return (weight.bfloat16().float() if weights == "bfloat16" else weight), bias


def assert_near(got: torch.Tensor, ref: torch.Tensor, weights: str) -> None:
    if weights == "bfloat16":  # x rounded to bf16 too where the build has AVX-512 BF16
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    else:
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def rotary_tables(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=gen) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def rms_norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; neox rotation: x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.double()[:, None] + rotated * sin.double()[:, None]


def linear64(x: torch.Tensor, layer: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    weight, bias = layer
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 13, 200])
def test_attention_input_equals_the_separate_ops(
    ext: CpuKernels, rows: int, bias: bool, weights: str
) -> None:
    gen = torch.Generator().manual_seed(rows + 7 * bias)
    hidden = torch.randn(rows, HIDDEN, generator=gen) * 3
    norm_w = torch.randn(HIDDEN, generator=gen)
    qkv_layer = linear(QKV, HIDDEN, gen, bias)
    cos, sin = rotary_tables(rows, gen)
    rotated = HEADS + KV_HEADS
    qkv_packed, qkv_bias = packed(ext, qkv_layer, weights)
    got = ext.decoder_attention_input(hidden, norm_w, EPS, qkv_packed, qkv_bias, QKV, cos, sin, rotated)

    normed = torch.empty_like(hidden)
    ext.rms_norm(normed, hidden, norm_w, EPS)
    want = separate_linear(ext, normed, qkv_layer, weights)
    ext.rotary_neox(want[:, : rotated * HEAD_DIM].view(rows, rotated, HEAD_DIM), cos, sin)
    assert torch.equal(got, want)

    ref = linear64(rms_norm64(hidden, norm_w), as_packed(qkv_layer, weights))
    qk = rotate64(ref[:, : rotated * HEAD_DIM].view(rows, rotated, HEAD_DIM), cos, sin)
    ref = torch.cat([qk.reshape(rows, -1), ref[:, rotated * HEAD_DIM :]], dim=1)
    assert_near(got, ref, weights)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 13, 200])
def test_mlp_half_equals_the_separate_ops(ext: CpuKernels, rows: int, bias: bool, weights: str) -> None:
    gen = torch.Generator().manual_seed(100 + rows + 7 * bias)
    hidden = torch.randn(rows, HIDDEN, generator=gen) * 3
    attn = torch.randn(rows, HEADS * HEAD_DIM, generator=gen)
    norm_w = torch.randn(HIDDEN, generator=gen)
    o_layer = linear(HIDDEN, HEADS * HEAD_DIM, gen, bias)
    gate_up_layer = linear(2 * INTER, HIDDEN, gen, bias)
    down_layer = linear(HIDDEN, INTER, gen, bias)
    got = hidden.clone()
    ext.decoder_mlp(
        got,
        attn,
        *packed(ext, o_layer, weights),
        norm_w,
        EPS,
        *packed(ext, gate_up_layer, weights),
        INTER,
        *packed(ext, down_layer, weights),
    )

    want = hidden.clone()
    attn_out = separate_linear(ext, attn, o_layer, weights)
    normed = torch.empty_like(want)
    ext.add_rms_norm(normed, want, attn_out, norm_w, EPS)
    gate_up = separate_linear(ext, normed, gate_up_layer, weights)
    act = gate_up.new_empty(rows, INTER)
    ext.silu_and_mul(act, gate_up)
    want += separate_linear(ext, act, down_layer, weights)
    assert torch.equal(got, want)

    residual = hidden.double() + linear64(attn, as_packed(o_layer, weights))
    gu = linear64(rms_norm64(residual, norm_w), as_packed(gate_up_layer, weights))
    act64 = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    ref = residual + linear64(act64, as_packed(down_layer, weights))
    assert_near(got, ref, weights)


def test_zero_tokens(ext: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.empty(0, HIDDEN)
    cos, sin = rotary_tables(0, gen)
    qkv_packed, qkv_bias = packed(ext, linear(QKV, HIDDEN, gen, False), "float32")
    out = ext.decoder_attention_input(hidden, torch.ones(HIDDEN), EPS, qkv_packed, qkv_bias, QKV, cos, sin, 6)
    assert out.shape == (0, QKV)
    ext.decoder_mlp(
        hidden, torch.empty(0, HEADS * HEAD_DIM), *packed(ext, linear(HIDDEN, HEADS * HEAD_DIM, gen, False), "float32"),
        torch.ones(HIDDEN), EPS, *packed(ext, linear(2 * INTER, HIDDEN, gen, False), "float32"), INTER,
        *packed(ext, linear(HIDDEN, INTER, gen, False), "float32"),
    )  # fmt: skip


def test_bad_inputs_are_refused_by_name(ext: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, HIDDEN, generator=gen)
    w = torch.ones(HIDDEN)
    cos, sin = rotary_tables(4, gen)
    qkv = packed(ext, linear(QKV, HIDDEN, gen, True), "float32")

    def attention_input(**change: object) -> None:
        args: dict[str, object] = dict(
            hidden=hidden, w=w, packed=qkv[0], bias=qkv[1], features=QKV, cos=cos, sin=sin, heads=6
        )
        args.update(change)
        ext.decoder_attention_input(
            args["hidden"], args["w"], EPS, args["packed"], args["bias"], args["features"], args["cos"],
            args["sin"], args["heads"],
        )  # fmt: skip

    with pytest.raises(
        RuntimeError, match=r"hidden must be a contiguous float32 CPU \[tokens, hidden_size\]"
    ):
        attention_input(hidden=torch.randn(HIDDEN, 4).T)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous float32 \[80\]"):
        attention_input(w=torch.ones(81))
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[4, 16\]"):
        attention_input(sin=sin[:3])
    with pytest.raises(
        RuntimeError, match=r"rotary_heads \(8\) x head_dim \(16\) exceeds the 112 q/k/v columns"
    ):
        attention_input(heads=8)
    panels, width = qkv[0].shape[0], ext.panel_width
    too_many = panels * width + 1
    with pytest.raises(
        RuntimeError,
        match=f"decoder_attention_input: out has {too_many} columns but packed holds {panels} panels of {width}",
    ):
        attention_input(features=too_many, bias=NO_BIAS)
    with pytest.raises(
        RuntimeError, match=r"decoder_attention_input: bias must be empty or a contiguous \[112\]"
    ):
        attention_input(bias=torch.ones(111))
    with pytest.raises(RuntimeError, match="qkv_features must be positive, got 0"):
        attention_input(features=0)

    o = packed(ext, linear(HIDDEN, HEADS * HEAD_DIM, gen, False), "float32")
    gate_up = packed(ext, linear(2 * INTER, HIDDEN, gen, False), "float32")
    down = packed(ext, linear(HIDDEN, INTER, gen, False), "float32")
    attn = torch.randn(4, HEADS * HEAD_DIM, generator=gen)
    before = hidden.clone()
    with pytest.raises(RuntimeError, match=r"decoder_mlp \(o_proj\): x must be \[rows, 80\]"):
        ext.decoder_mlp(hidden, attn[:, :79], *o, w, EPS, *gate_up, INTER, *down)
    gate_up_panels = f"{gate_up[0].shape[0]} panels of {ext.panel_width}"
    with pytest.raises(
        RuntimeError,
        match=rf"decoder_mlp \(gate_up_proj\): out has 162 columns but packed holds {gate_up_panels}",
    ):
        ext.decoder_mlp(hidden, attn, *o, w, EPS, *gate_up, INTER + 9, *down)
    # a gate/up split that fits the panels but not down_proj's inputs: refused before o_proj
    # has added anything to hidden
    with pytest.raises(RuntimeError, match=r"decoder_mlp \(down_proj\): x must be \[rows, 72\]"):
        ext.decoder_mlp(hidden, attn, *o, w, EPS, *gate_up, INTER - 1, *down)
    with pytest.raises(RuntimeError, match="intermediate_size must be positive, got 0"):
        ext.decoder_mlp(hidden, attn, *o, w, EPS, *gate_up, 0, *down)
    with pytest.raises(RuntimeError, match="hidden must be a contiguous float32 CPU"):
        ext.decoder_mlp(hidden.double(), attn, *o, w, EPS, *gate_up, INTER, *down)
    assert torch.equal(hidden, before)
