"""The owned Llama-family model computes what transformers' modules compute (through our paged
attention), on tiny random models of every owned architecture; other architectures run on
transformers' modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pagedserve.benchmarks.tiny_models import (
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
    tiny_config,
)
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.models import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    PagedStep,
    TransformersCausalLM,
    build_causal_lm,
)
from pagedserve.dataplane.models.layers import RotaryEmbedding, rms_norm
from pagedserve.dataplane.runner.cpu_linear import PackedLinear, PanelLinear, pack_linears
from pagedserve.dataplane.runner.model_loader import load_model
from pagedserve.kernels import build_attention_metadata, resolve_backend
from pagedserve.kernels.cpu_ext import load_cpu_kernels

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: make_tiny_model(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


def owned(path: Path, dtype: str = "float32") -> LlamaForCausalLM:
    model = load_model(path, dtype, "cpu", model_impl="pagedserve")
    assert isinstance(model, LlamaForCausalLM)
    return model


class PagedDriver:
    """Runs a model's decoder over our paged caches, one flattened step at a time."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, head_dim)
        self.model = model
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
        self.backends = resolve_backend(None, torch.device("cpu"), torch.float32, torch.float32)

    @torch.inference_mode()
    def step(self, seqs: list[tuple[list[int], int, int, list[int]]]) -> torch.Tensor:
        """seqs: (all token ids, computed so far, new tokens, block table) -> logits [T, vocab]."""
        ids: list[int] = []
        pos: list[int] = []
        for tokens, start, n, _ in seqs:
            ids += tokens[start : start + n]
            pos += list(range(start, start + n))
        meta = build_attention_metadata(
            [n for _, _, n, _ in seqs],
            [s + n for _, s, n, _ in seqs],
            [t for *_, t in seqs],
            BLOCK_SIZE,
            "cpu",
        )
        step = PagedStep(meta, self.caches, self.backends)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), step)
        return self.model.compute_logits(hidden)


def chunked_schedule() -> list[list[tuple[int, int, int]]]:
    """(sequence, computed, new) per step: chunked prefills next to prefills and decodes."""
    return [
        [(0, 0, 9), (1, 0, 5)],  # A whole prompt, B first chunk
        [(0, 9, 1), (1, 5, 6)],  # A decodes, B's second chunk sees a cached prefix
        [(0, 10, 1), (1, 11, 1), (2, 0, 3)],  # two decodes and a new short prompt
        [(0, 11, 1), (1, 12, 1), (2, 3, 1)],
    ]


@pytest.mark.parametrize("elementwise", ["torch", "cpp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_owned_logits_equal_transformers(model_dirs: dict[str, Path], arch: str, elementwise: str) -> None:
    plain = load_model(model_dirs[arch], "float32", "cpu", model_impl="transformers")
    fused = owned(model_dirs[arch])
    ops = load_cpu_kernels(strict=True) if elementwise == "cpp" else None
    assert fused.use_cpu_kernels(ops) == (fused.num_layers if ops is not None else 0)
    assert [type(layer) for layer in fused.layers] == [LlamaDecoderLayer] * fused.num_layers
    assert all(layer.cpu_ops is ops for layer in fused.decoder_layers())
    assert isinstance(plain, TransformersCausalLM) and plain.implementation == "transformers"
    assert not any(isinstance(m, LlamaDecoderLayer) for m in plain.modules())
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, 384, (16,), generator=gen).tolist() for _ in range(3)]
    tables = [list(range(0, 4)), list(range(10, 14)), list(range(20, 24))]
    drivers = PagedDriver(plain), PagedDriver(fused)
    for plan in chunked_schedule():
        seqs = [(tokens[s], start, n, tables[s]) for s, start, n in plan]
        want, got = (d.step(seqs) for d in drivers)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Both wrote the same keys and values into the same slots.
    for (k0, v0), (k1, v1) in zip(drivers[0].caches, drivers[1].caches, strict=True):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_with_chunked_prefill_matches_transformers(
    model_dirs: dict[str, Path], arch: str
) -> None:
    llm = LLM(
        str(model_dirs[arch]), max_model_len=128, block_size=4, max_num_batched_tokens=6, max_num_seqs=4
    )
    model = llm.engine.runner.model
    assert isinstance(model, LlamaForCausalLM)
    layers = model.decoder_layers()
    assert len(layers) == model.num_layers
    # fp32 on the CPU: the engine runs the C++ elementwise kernels, and every linear (the
    # LM head too) is the C++ panel linear
    assert all(layer.cpu_ops is not None for layer in layers)
    # ... and each layer's halves around attention as one C++ op each (Qwen3's q/k norm keeps
    # its attention input op by op)
    assert all((layer.attention_input_args is not None) == (arch != "qwen3") for layer in layers)
    assert all(layer.mlp_args is not None for layer in layers)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PanelLinear)]
    assert len(linears) == 4 * len(layers) + 1  # qkv, o, gate_up, down per layer; the LM head
    assert isinstance(model.lm_head, PanelLinear)
    assert not any(isinstance(m, nn.Linear | PackedLinear) for m in llm.engine.runner.model.modules())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (1, 7, 13, 22)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    ref_model = load_reference_model(model_dirs[arch])
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert_same_greedy(out.token_ids, reference_greedy(ref_model, prompt, 8), f"{arch} prompt {i}")
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_auto_picks_the_owned_model_and_transformers_is_kept_on_request(model_dirs: dict[str, Path]) -> None:
    auto = load_model(model_dirs["qwen3"], "float32", "cpu")
    assert isinstance(auto, LlamaForCausalLM) and auto.implementation == "pagedserve"
    # the q/k norms travel with their layer; nothing of transformers' modules is left
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in auto.decoder_layers())
    assert not any(type(m).__module__.startswith("transformers.") for m in auto.modules())
    forced = load_model(model_dirs["qwen3"], "float32", "cpu", model_impl="transformers")
    assert isinstance(forced, TransformersCausalLM)
    assert type(forced.hf).__name__ == "Qwen3ForCausalLM"


def test_rotary_tables_equal_transformers_for_every_static_rope_type() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ropes: list[dict[str, Any]] = [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ]
    positions = torch.tensor([0, 1, 2, 17, 63, 200, 5])
    for rope in ropes:
        cfg = tiny_config("llama", rope_parameters=rope, max_position_embeddings=256)
        want_cos, want_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
        cos, sin = RotaryEmbedding.from_config(cfg)(positions, torch.float32)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), rope["rope_type"]
    dynamic = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        RotaryEmbedding.from_config(dynamic)


def test_wrapped_output_projections_are_called_as_modules(model_dirs: dict[str, Path]) -> None:
    """o_proj / down_proj may be wrappers (tensor parallelism all-reduces in them): kept as they are."""

    class Wrapper(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.linear = linear
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.linear(x)

    model = owned(model_dirs["llama"])
    layer = model.decoder_layers()[0]
    o_proj, down_proj = Wrapper(layer.o_proj), Wrapper(layer.down_proj)
    layer.o_proj, layer.down_proj = o_proj, down_proj
    PagedDriver(model).step([([5, 6, 7], 0, 3, [0])])
    assert (o_proj.calls, down_proj.calls) == (1, 1)


def test_unknown_architectures_run_on_transformers_modules() -> None:
    class OtherLayer(nn.Module):
        pass

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([OtherLayer(), OtherLayer()])

    class Model(nn.Module):
        config = tiny_config("llama")
        dtype = torch.float32

        def __init__(self) -> None:
            super().__init__()
            self.decoder = Decoder()

        def get_decoder(self) -> nn.Module:
            return self.decoder

    model = Model()
    before = list(model.decoder.layers)
    wrapped = build_causal_lm(model)
    assert isinstance(wrapped, TransformersCausalLM) and wrapped.hf is model
    assert list(model.decoder.layers) == before
    with pytest.raises(
        ValueError,
        match=r"model_impl pagedserve: Model cannot run on the owned models \(no model file for OtherLayer\)",
    ):
        build_causal_lm(Model(), "pagedserve")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        build_causal_lm(Model(), "vllm")


def test_elementwise_kernels_only_for_fp32(model_dirs: dict[str, Path]) -> None:
    ops = load_cpu_kernels(strict=True)
    model = owned(model_dirs["llama"], "bfloat16")
    assert model.use_cpu_kernels(ops) == 0
    assert all(layer.cpu_ops is None for layer in model.decoder_layers())


def test_rms_norm_is_bit_identical_to_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(3)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data.normal_()
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96) * 7
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    x16 = torch.randn(4, 96).bfloat16()
    norm16 = norm.to(torch.bfloat16)
    assert torch.equal(rms_norm(x16, norm16.weight, norm16.variance_epsilon), norm16(x16))


@pytest.mark.parametrize("bf16_weights", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_block_kernels_are_bit_identical_to_the_op_by_op_layers(
    model_dirs: dict[str, Path], arch: str, bf16_weights: bool
) -> None:
    """Each layer's halves as one C++ op each (bind_block_kernels) give the very same logits
    and cached K/V as the same layers op by op, over prefills, chunks and decodes, with fp32
    and with bf16 weight panels."""
    ops = load_cpu_kernels(strict=True)
    models = []
    for bind in (False, True):
        model = owned(model_dirs[arch])
        model.use_cpu_kernels(ops)
        pack_linears(model, panel_ops=ops, bf16_weights=bf16_weights)
        layers = model.num_layers
        if bind:
            # Qwen3's q/k norm sits between the projection and rotary: that half stays op by op.
            assert model.bind_block_kernels() == (0 if arch == "qwen3" else layers, layers)
        models.append(model)
    gen = torch.Generator().manual_seed(4)
    tokens = [torch.randint(3, 384, (16,), generator=gen).tolist() for _ in range(3)]
    tables = [list(range(0, 4)), list(range(10, 14)), list(range(20, 24))]
    drivers = PagedDriver(models[0]), PagedDriver(models[1])
    for plan in chunked_schedule():
        seqs = [(tokens[s], start, n, tables[s]) for s, start, n in plan]
        want, got = (d.step(seqs) for d in drivers)
        assert torch.equal(got, want)
    for (k0, v0), (k1, v1) in zip(drivers[0].caches, drivers[1].caches, strict=True):
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_block_kernels_need_panel_linears_and_the_cpu_kernels(model_dirs: dict[str, Path]) -> None:
    ops = load_cpu_kernels(strict=True)
    torch_layers = owned(model_dirs["llama"])
    pack_linears(torch_layers, panel_ops=ops)  # no C++ kernels for the layers: nothing to bind
    assert torch_layers.bind_block_kernels() == (0, 0)
    onednn = owned(model_dirs["llama"])
    onednn.use_cpu_kernels(ops)
    pack_linears(onednn)  # oneDNN-packed linears: not the panel layout the ops read
    assert onednn.bind_block_kernels() == (0, 0)
    assert all(
        layer.attention_input_args is None and layer.mlp_args is None for layer in onednn.decoder_layers()
    )


def test_bf16_weights_engine_keeps_fp32_activations_and_frees_every_block(
    model_dirs: dict[str, Path],
) -> None:
    """--cpu-weight-dtype bfloat16: every linear is a panel linear over bf16 panels (half the
    bytes), the layers run as the block ops over those panels, and the logits stay within
    bf16 rounding of the fp32 model's."""
    fp32 = LLM(str(model_dirs["llama"]), max_model_len=64, block_size=4, max_num_seqs=4)
    bf16 = LLM(
        str(model_dirs["llama"]), max_model_len=64, block_size=4, max_num_seqs=4, cpu_weight_dtype="bfloat16"
    )
    assert bf16.engine.config.model.cpu_weight_dtype == "bfloat16"
    panels = [m for m in bf16.engine.runner.model.modules() if isinstance(m, PanelLinear)]
    layers = bf16.engine.runner.model.decoder_layers()
    assert len(panels) == 4 * len(layers) + 1 and all(p.bf16_weights for p in panels)
    assert all(p.panels.dtype == torch.bfloat16 for p in panels)
    fp32_panels = [m for m in fp32.engine.runner.model.modules() if isinstance(m, PanelLinear)]
    assert sum(p.panels.numel() * p.panels.element_size() for p in panels) * 2 >= sum(
        p.panels.numel() * p.panels.element_size() for p in fp32_panels
    )
    for llm in (fp32, bf16):
        bound = llm.engine.runner.model.decoder_layers()
        assert all(layer.attention_input_args is not None and layer.mlp_args is not None for layer in bound)
    assert all(
        args.dtype == torch.bfloat16
        for args in layers[0].mlp_args
        if isinstance(args, torch.Tensor) and args.dim() == 4
    )
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 384, (16,), generator=gen).tolist()
    logits = []
    for llm in (fp32, bf16):
        driver = PagedDriver(llm.engine.runner.model)
        logits.append(driver.step([(tokens, 0, 16, list(range(4)))]))
    scale = logits[0].abs().max()
    err = (logits[1] - logits[0]).abs().max()
    assert 0 < err < 0.05 * scale  # rounded, but only by bf16's 8-bit mantissa
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = bf16.generate([tokens, tokens[:5]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert bf16.engine.pool.num_free_blocks == bf16.engine.pool.num_blocks
