"""The C++ elementwise layer kernels (kernels/src/pagedserve/kernels/cpu/layer_ops.cpp) against transformers' math.

The extension must build here (load_cpu_kernels(strict=True)). Residual adds and rotary are
asserted bit-identical; RMSNorm and SiLU within a few ulp (their sum order and exp differ).
Widths cover the vector body and the scalar tail (16 floats per vector).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pagedserve.kernels.cpu_ext import CpuKernels


def llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


@pytest.mark.parametrize("width", [576, 100, 7])
@pytest.mark.parametrize("rows", [0, 1, 34, 700])
def test_rms_norm_matches_transformers(ext: CpuKernels, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    # A row stride wider than the row: the kernel reads views of a bigger buffer.
    base = torch.randn(rows, width + 5, generator=gen) * 3
    x = base[:, :width]
    weight = torch.randn(width, generator=gen)
    out = torch.full((rows, width), float("nan"))
    ext.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, llama_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("width", [576, 100])
def test_add_rms_norm_adds_in_place_exactly(ext: CpuKernels, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    residual = torch.randn(64, width, generator=gen)
    delta = torch.randn(64, width, generator=gen) * 5
    weight = torch.randn(width, generator=gen)
    want_residual = residual + delta
    out = torch.empty(64, width)
    ext.add_rms_norm(out, residual, delta, weight, 1e-6)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(out, llama_norm(want_residual, weight, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_and_mul_matches_torch(ext: CpuKernels, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(33, 2 * inter, generator=gen) * 6
    # The extremes: exp(-x) underflows / overflows in float32 beyond about +-88.
    gate_up[0, :8] = torch.tensor([-1e4, -100.0, -88.5, -20.0, 0.0, 20.0, 100.0, 1e4])
    out = torch.empty(33, inter)
    ext.silu_and_mul(out, gate_up)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-30)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: a 24-wide half, vector + tail
def test_rotary_is_bit_identical_to_transformers(ext: CpuKernels, head_dim: int) -> None:
    tokens, heads, kv_heads = 19, 6, 2
    gen = torch.Generator().manual_seed(head_dim)
    # q and k as the fused layer holds them: the first columns of one qkv output.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 500
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    # transformers' layout: q, k [batch, heads, T, D], cos/sin [batch, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(
        qk[:, :heads].transpose(0, 1).unsqueeze(0),
        qk[:, heads:].transpose(0, 1).unsqueeze(0),
        cos.unsqueeze(0),
        sin.unsqueeze(0),
    )
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ext.rotary_neox(qk, cos, sin)
    assert torch.equal(qk[:, :heads], q_ref[0].transpose(0, 1))
    assert torch.equal(qk[:, heads:], k_ref[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_results_do_not_depend_on_thread_count(ext: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    gate_up = torch.randn(2048, 2 * 1536, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            norm, act = torch.empty_like(x), torch.empty(2048, 1536)
            ext.rms_norm(norm, x, weight, 1e-5)
            ext.silu_and_mul(act, gate_up)
            results.append((norm, act))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bad_inputs_are_refused_by_name(ext: CpuKernels) -> None:
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ext.rms_norm(torch.empty(4, 32), x.double(), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous float32 \[32\]"):
        ext.rms_norm(torch.empty(4, 32), x, torch.ones(31), 1e-5)
    with pytest.raises(RuntimeError, match=r"out must be \[4, 16\]"):
        ext.silu_and_mul(torch.empty(4, 32), x)
    with pytest.raises(RuntimeError, match="qk needs a contiguous head_dim"):
        ext.rotary_neox(torch.randn(4, 2, 32).transpose(1, 2), torch.ones(4, 2), torch.ones(4, 2))
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[4, 32\]"):
        ext.rotary_neox(torch.randn(4, 2, 32), torch.ones(4, 16), torch.ones(4, 32))


def test_cpp_cache_write_equals_torch_and_checks_slots(ext: CpuKernels) -> None:
    from pagedserve.kernels import write_kv_cache
    from pagedserve.kernels.cache_ops import write_kv_cache_torch

    gen = torch.Generator().manual_seed(9)
    shape = (6, 4, 3, 64)  # 6 blocks of 4 slots, 3 kv heads
    # key/value as the fused layers pass them: strided views into one qkv output
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen)
    key = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    value = qkv[:, 12 * 64 :].view(5, 3, 64)
    slots = torch.tensor([23, 0, 7, 8, 13])
    want = torch.zeros(shape), torch.zeros(shape)
    got = torch.zeros(shape), torch.zeros(shape)
    write_kv_cache_torch(key, value, *want, slots)
    write_kv_cache(key, value, *got, slots, impl="cpp")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    before = got[0].clone()
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 24 is not a slot of the cache \(24 slots\)"):
        write_kv_cache(key[:2], value[:2], *got, torch.tensor([3, 24]), impl="cpp")
    assert torch.equal(got[0], before)  # checked before anything was written
    with pytest.raises(ValueError, match="impl='cpp' writes float32 or bfloat16 CPU caches"):
        write_kv_cache(key, value, got[0].double(), got[1].double(), slots, impl="cpp")
