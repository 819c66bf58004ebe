"""The default model's own Q4_1 GGUF file (`SmolLM2-135M-Instruct-Q4_1`, pulled by `make pull`),
served quantized, against the same file de-quantized to fp32 by transformers
(`SmolLM2-135M-Instruct`).

With `quantized_matmul="float32"` no activation is quantized: every weight the quantized model
multiplies by equals the fp32 model's bit for bit (checked), and the quantized kernel equals
the fp32 panel kernel on the de-quantized weight bit for bit
(tests/kernels/test_cpu_quant_linear.py). What remains is the
order of accumulation where the fp32 engine runs a layer half as one fused op or a shape on
oneDNN: logits then differ by float32 rounding only, bounded here by 1e-3 on the first
token's log-probabilities, and greedy tokens may part only at a numerical tie. With int8
activations (the default on x86) the LM head's logits stay within the rounding's bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.benchmarks.tiny_models import TIE_TOLERANCE
from pagedserve.benchmarks.workloads import SHORT_QUESTIONS
from pagedserve.common.models import DEFAULT_MODEL, resolve_model_path
from pagedserve.common.models.gguf_folder import gguf_weights_file
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.runner.gguf_loader import load_gguf_model
from pagedserve.dataplane.runner.quant_linear import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.real_model

QUANTIZED = f"{DEFAULT_MODEL}-Q4_1"
QUESTIONS = SHORT_QUESTIONS[:12]


def test_the_quantized_weights_are_the_fp32_models_weights_exactly() -> None:
    folder = resolve_model_path(QUANTIZED)
    gguf = gguf_weights_file(folder)
    assert gguf is not None and gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = load_gguf_model(folder, gguf, "sdpa")
    reference = load_file(resolve_model_path(DEFAULT_MODEL) / "model.safetensors")
    kinds: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and name != "lm_head":  # lm_head: tied
            kinds[module.weight_q.kind] = kinds.get(module.weight_q.kind, 0) + 1
            assert torch.equal(module.weight_q.dequantize(), reference[name + ".weight"]), name
    assert kinds == {"Q4_1": 210, "Q8_0": 1}  # 30 layers x 7 linears, and the embedding
    assert (
        isinstance(model.lm_head, QuantLinear) and model.lm_head.weight_q is model.model.embed_tokens.weight_q
    )


def test_greedy_chat_tokens_equal_the_fp32_engines() -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for name in (QUANTIZED, DEFAULT_MODEL):
        llm = LLM(name, kv_cache_memory=128 << 20, quantized_matmul="float32")
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        runs[name] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    ties = 0
    for i, (got, want) in enumerate(zip(runs[QUANTIZED], runs[DEFAULT_MODEL], strict=True)):
        got_top, want_top = got.outputs[0].top_logprobs, want.outputs[0].top_logprobs
        assert got_top is not None and want_top is not None
        first_got, first_want = got_top[0], want_top[0]
        assert [t for t, _ in first_got] == [t for t, _ in first_want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(first_got, first_want, strict=True)) < 1e-3
        if got.token_ids == want.token_ids:
            continue
        pos = next(j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b)
        (_, best), (_, runner_up) = want_top[pos][:2]
        assert best - runner_up < TIE_TOLERANCE * 10, f"prompt {i} parts at token {pos} without a tie"
        ties += 1
    assert ties <= 1


def test_a_gguf_path_is_served_through_a_folder_made_once(tmp_path: Path) -> None:
    source = gguf_weights_file(resolve_model_path(QUANTIZED))
    assert source is not None
    copy = tmp_path / "smol.gguf"
    copy.symlink_to(source)
    store = tmp_path / "store"
    folder = resolve_model_path(str(copy), store)
    linked = gguf_weights_file(folder)
    assert folder.parent == store / ".gguf" and linked is not None and linked.resolve() == source.resolve()
    assert resolve_model_path(str(copy), store) == folder  # reused, not made again
    llm = LLM(str(copy), model_home=str(store), kv_cache_memory=64 << 20)
    reference = LLM(QUANTIZED, kv_cache_memory=64 << 20)
    prompt = reference.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    assert llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]) == prompt
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert (
        llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        == reference.generate([prompt], params, use_tqdm=False)[0].token_ids
    )


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_perplexity_of_a_requantized_file_is_within_1_percent_of_fp32(type_name: str, tmp_path: Path) -> None:
    """A GGUF file made from the fp32 model's weights (Q4_K: ffn_down; the 576-input rows are not
    whole 256-weight super-blocks and stay Q8_0, as llama.cpp falls back too), served quantized."""
    from pagedserve.benchmarks.gguf_quality import engine_perplexity
    from pagedserve.benchmarks.gguf_write import write_gguf_like
    from pagedserve.benchmarks.workloads import PASSAGES_FILE
    from pagedserve.dataplane.runner.model_loader import load_tokenizer

    fp32 = resolve_model_path(DEFAULT_MODEL)
    template = gguf_weights_file(resolve_model_path(QUANTIZED))
    assert template is not None
    path = write_gguf_like(
        template, load_file(fp32 / "model.safetensors"), tmp_path / f"{type_name}.gguf", type_name
    )
    tokenizer = load_tokenizer(fp32)
    assert tokenizer is not None
    ids = tokenizer.encode(PASSAGES_FILE.read_text(), add_special_tokens=False)[:512]
    base = engine_perplexity(DEFAULT_MODEL, ids, 256)
    quantized = engine_perplexity(str(path), ids, 256)
    assert abs(quantized / base - 1) < 0.01, (quantized, base)


def test_next_token_logits_with_int8_activations_stay_within_the_rounding_bound() -> None:
    """The default file's LM head (Q8_0, tied) on the real final hidden states of 12 chat
    prompts, by integer dot products: each hidden value is rounded to a step of its block's
    max |x| / 127, so each logit moves at most sum over k of |w[v, k]| * step(k) / 2 from the
    de-quantized fp32 product (plus float32 slack); the same holds for every layer's
    matmuls (tests/kernels/test_cpu_quant_linear.py). The bound is the worst case, every
    rounding of a row pulling one way; the roundings are unbiased, so the mean error is a
    small part of it."""
    from pagedserve.kernels.cpu_ext import load_cpu_kernels
    from pagedserve.kernels.quant import pack_quant_panels, quant_panel_linear, round_activations

    ops = load_cpu_kernels(strict=True)
    assert ops is not None
    folder = resolve_model_path(QUANTIZED)
    gguf = gguf_weights_file(folder)
    assert gguf is not None
    model = load_gguf_model(folder, gguf, "sdpa")
    head = model.lm_head.weight_q
    llm = LLM(DEFAULT_MODEL, kv_cache_memory=64 << 20)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    hidden = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden.append(model.model(torch.tensor([prompt])).last_hidden_state[0, -1])
    x = torch.stack(hidden).contiguous()  # [12, 576], the rows the LM head reads
    got = quant_panel_linear(ops, x, pack_quant_panels(head, ops.panel_width), int8_activations=True)
    dense = head.dequantize().double()
    exact = x.double() @ dense.T
    _, steps = round_activations(x, head.group)
    step = steps.double().repeat_interleave(x.shape[1] // steps.shape[1], dim=1)
    bound = (step / 2) @ dense.abs().T  # [12, vocab]
    error = (got.double() - exact).abs()
    assert bool((error <= bound * (1 + 1e-6) + 1e-4).all())
    assert float(error.max()) > 0
    assert float(error.mean()) < 0.25 * float(bound.mean())
