"""The per-ISA builds of the C++ CPU kernels (kernels/src/pagedserve/kernels/cpu_ext.py): which level a CPU runs,
the override, and how the builds' results relate.

Every build this machine executes is loaded side by side (each under its own op namespace).
Where a build has fused multiply-add (AVX-512, AVX2, aarch64 NEON) every kernel does the same
per-element arithmetic in the same order, so its results must equal the native build's bit
for bit, whatever its vector width and tile shapes. The x86-64 baseline (SSE2) has no FMA:
a multiply and an add round twice, so it is held to a float64 tolerance instead.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from test_paged_attention import MIXED_QUERY_LENS, MIXED_SEQ_LENS, make_batch

from pagedserve.kernels import cpu_ext, cpu_isa, paged_attention
from pagedserve.kernels.cpu_ext import INT8_DOT_PRODUCTS, CpuKernels, load_cpu_kernels
from pagedserve.kernels.cpu_isa import (
    CPU_ISAS,
    ISA_ENV,
    check_isa,
    cpu_flags,
    isa_for_flags,
    native_isa,
    runnable_isas,
    selected_isa,
)
from pagedserve.kernels.linear import NO_BIAS, pack_panels, panel_linear
from pagedserve.kernels.quant import pack_quant_panels, quant_panel_linear, quantize_4bit, quantize_int8

ZEN4 = frozenset(["fma", "f16c", "avx", "avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"])
ZEN3 = frozenset(["sse4_2", "fma", "f16c", "avx", "avx2", "bmi2"])
SANDY_BRIDGE = frozenset(["sse4_2", "avx"])

# A build without FMA: the x86-64 baseline.
NO_FMA = platform.machine().lower() in ("x86_64", "amd64") and native_isa() != "portable"


def _exact(isa: str) -> bool:
    return not (isa == "portable" and NO_FMA)


@pytest.mark.parametrize(
    ("flags", "x86", "isa"),
    [
        (ZEN4, True, "avx512"),
        (ZEN3, True, "avx2"),
        (ZEN4 - {"avx512vl"}, True, "avx2"),  # every AVX-512 subset the kernels use, or none
        (ZEN3 - {"fma"}, True, "portable"),
        (SANDY_BRIDGE, True, "portable"),
        (frozenset(["fp", "asimd", "sve"]), False, "portable"),
    ],
    ids=["zen4", "zen3", "avx512-without-vl", "avx2-without-fma", "sandy-bridge", "arm"],
)
def test_isa_for_flags(flags: frozenset[str], x86: bool, isa: str) -> None:
    assert isa_for_flags(flags, x86) == isa


def test_runnable_isas_are_the_native_level_and_below() -> None:
    isas = runnable_isas()
    assert isas[0] == native_isa() and isas[-1] == "portable"
    assert isas == CPU_ISAS[CPU_ISAS.index(native_isa()) :]


def test_selected_isa_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert selected_isa() == native_isa()
    monkeypatch.setenv(ISA_ENV, "auto")
    assert selected_isa() == native_isa()
    monkeypatch.setenv(ISA_ENV, "portable")
    assert selected_isa() == "portable"
    monkeypatch.setenv(ISA_ENV, "avx9")
    with pytest.raises(
        ValueError, match=r"PAGEDSERVE_CPU_ISA: unknown instruction set 'avx9'; choose auto, avx512"
    ):
        selected_isa()
    with pytest.raises(ValueError, match="unknown instruction set 'avx9'"):
        load_cpu_kernels(isa="avx9")


def test_a_level_above_the_cpu_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on an AVX2-only CPU (Zen 3): the check is cached, so call its undecorated body.
    monkeypatch.setattr(cpu_isa, "native_isa", lambda: "avx2")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ZEN3)
    with pytest.raises(
        ValueError,
        match=r"PAGEDSERVE_CPU_ISA=avx512: this CPU cannot run it \(missing avx512bw, avx512dq, avx512f, "
        r"avx512vl\); it runs avx2, portable",
    ):
        check_isa.__wrapped__("avx512")
    assert check_isa.__wrapped__("avx2") == "avx2"


def test_each_build_reports_its_isa_and_panel_width() -> None:
    widths = {"avx512": 32, "avx2": 16, "portable": 8}
    for isa in runnable_isas():
        ops = load_cpu_kernels(strict=True, isa=isa)
        assert ops is not None and ops.isa == isa
        assert ops.panel_width == widths[isa]
        assert f"-DPAGEDSERVE_OPS=pagedserve_cpu_{isa}" in ops.cflags
        if isa != native_isa():
            assert "-march=native" not in ops.cflags  # built for the level, not for this CPU


def _compare(isa: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if _exact(isa):
        assert torch.equal(got, want), f"{isa}: differs from the {native_isa()} build"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _native_and(isa: str) -> tuple[CpuKernels, CpuKernels]:
    """The native build and the `isa` one (a skip where this CPU runs only portable)."""
    if isa == "none":
        pytest.skip("this CPU runs only the portable build")
    native = load_cpu_kernels(strict=True, isa=native_isa())
    other = load_cpu_kernels(strict=True, isa=isa)
    assert native is not None and other is not None
    return native, other


@pytest.mark.parametrize("isa", runnable_isas()[1:] or ["none"])
def test_panel_linear_matches_the_native_build(isa: str) -> None:
    native, other = _native_and(isa)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 576, generator=gen) / 24
    bias = torch.randn(100, generator=gen)
    for rows in (1, 5, 13, 34, 200):
        x = torch.randn(rows, 576, generator=gen)
        want = panel_linear(native, x, pack_panels(weight, native.panel_width), 100, bias)
        got = panel_linear(other, x, pack_panels(weight, other.panel_width), 100, bias)
        _compare(isa, got, want)
    empty = panel_linear(other, torch.empty(0, 576), pack_panels(weight, other.panel_width), 100, NO_BIAS)
    assert empty.shape == (0, 100)


@pytest.mark.parametrize("isa", runnable_isas()[1:] or ["none"])
def test_quantized_linear_matches_the_native_build_in_floats_and_in_integers(isa: str) -> None:
    """The integer sums are exact on every build (vpdpbusd, vpmaddubsw, the generic form) and
    the float epilogue runs in one order, so int8 activations give the same bits too."""
    native, other = _native_and(isa)
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(100, 576, generator=gen) / 24
    bias = torch.randn(100, generator=gen)
    for weight in (quantize_4bit(dense), quantize_int8(dense, 32), quantize_int8(dense)):
        for rows in (1, 7, 34):
            x = torch.randn(rows, 576, generator=gen)
            for int8 in (False, True):
                want = quant_panel_linear(
                    native, x, pack_quant_panels(weight, native.panel_width), bias, int8_activations=int8
                )
                got = quant_panel_linear(
                    other, x, pack_quant_panels(weight, other.panel_width), bias, int8_activations=int8
                )
                _compare(isa, got, want)


@pytest.mark.parametrize("isa", runnable_isas()[1:] or ["none"])
def test_attention_matches_the_native_build(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode and prefill rows of one mixed batch, through the engine's dispatcher."""
    if isa == "none":
        pytest.skip("this CPU runs only the portable build")
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, block_size=4, num_kv_heads=2, group=3, head_dim=64)

    def run(level: str) -> torch.Tensor:
        monkeypatch.setenv(ISA_ENV, level)
        return paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, impl="cpp"
        )

    _compare(isa, run(isa), run(native_isa()))


def test_avx512_without_vnni_sums_the_same_integers(tmp_path: Path) -> None:
    """AVX-512 CPUs before VNNI (Skylake-SP) sum the int8 products with vpmaddubsw +
    vpmaddwd instead of vpdpbusd: the quantized linear alone, built for Skylake-AVX512 on a
    CPU that runs it, equals the native build bit for bit."""
    if native_isa() != "avx512" or "avx512_vnni" not in cpu_flags():
        pytest.skip("needs an AVX-512 VNNI CPU: the native build is the VNNI one")
    from torch.utils.cpp_extension import load

    load(
        name="pagedserve_quant_skx",
        sources=[str(Path(cpu_ext.__file__).parent / "cpu" / "linear_quant.cpp")],
        extra_cflags=["-O3", "-march=skylake-avx512", "-std=c++20", "-DPAGEDSERVE_OPS=pagedserve_quant_skx"],
        build_directory=str(tmp_path),
        is_python_module=False,
    )
    skx = torch.ops.pagedserve_quant_skx
    native = load_cpu_kernels(strict=True, isa="avx512")
    assert native is not None and native.int8_dot_products == "avx512_vnni"
    assert INT8_DOT_PRODUCTS[int(skx.quant_int_dot_products())] == "avx512bw"
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(100, 576, generator=gen) / 24
    for weight in (quantize_4bit(dense), quantize_int8(dense, 32), quantize_int8(dense)):
        packed = pack_quant_panels(weight, native.panel_width).packed
        for rows in (1, 7, 34):
            x = torch.randn(rows, 576, generator=gen)
            for int8 in (False, True):
                got, want = torch.empty(rows, 100), torch.empty(rows, 100)
                skx.quant_panel_linear(got, x, packed, NO_BIAS, int8)
                native.quant_panel_linear(want, x, packed, NO_BIAS, int8)
                assert torch.equal(got, want), (weight.kind, rows, int8)
