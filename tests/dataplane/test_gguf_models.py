"""GGUF models served quantized: tiny random Llama and Qwen2 models written as GGUF files (the
`gguf` package quantizes their linears and the token embedding; llama.cpp's q/k row order for
Llama), loaded by pagedserve.dataplane.runner.gguf_loader, against an fp32 engine on the
de-quantized weights; and the refusals of files that cannot be served.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file, save_file

from pagedserve.benchmarks.gguf_write import gguf_name
from pagedserve.benchmarks.tiny_models import exactness_workload, make_tiny_model
from pagedserve.common.models.gguf_folder import GgufError, check_gguf, gguf_model_folder
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.models import LlamaDecoderLayer
from pagedserve.dataplane.runner.gguf_loader import load_gguf_model, rotary_row_order
from pagedserve.dataplane.runner.quant_linear import QuantEmbedding, QuantLinear


def write_gguf(hf_folder: Path, dst: Path, arch: str, qtype: str) -> Path:
    """`hf_folder`'s model as a GGUF folder in `dst` (config.json + model.gguf, linears and
    embedding in `qtype`), and its de-quantized fp32 twin in `dst`-fp32; returns `dst`."""
    config = json.loads((hf_folder / "config.json").read_text())
    state = load_file(hf_folder / "model.safetensors")
    dst.mkdir(parents=True)
    twin = dst.with_name(dst.name + "-fp32")
    twin.mkdir()
    writer = GGUFWriter(str(dst / "model.gguf"), arch)
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        data = tensor.numpy()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(
            name.split(".")[-2]
        )
        if arch == "llama" and heads is not None:  # llama.cpp's converter's row order
            data = data[np.argsort(rotary_row_order(data.shape[0], heads).numpy())]
        if data.ndim == 2:
            raw = quants.quantize(data, GGMLQuantizationType[qtype])
            writer.add_tensor(gguf_name(name), raw, raw_dtype=GGMLQuantizationType[qtype])
            back = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
            if arch == "llama" and heads is not None:
                back = back[rotary_row_order(back.shape[0], heads)]
            dequantized[name] = back.contiguous()
        else:
            writer.add_tensor(gguf_name(name), data)
            dequantized[name] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copy(hf_folder / "config.json", dst / "config.json")
    shutil.copy(hf_folder / "config.json", twin / "config.json")
    save_file(dequantized, twin / "model.safetensors")
    return dst


@pytest.fixture(scope="module", params=[("llama", "Q8_0"), ("qwen2", "Q4_1"), ("llama", "Q4_0")])
def gguf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    arch, qtype = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    hf = make_tiny_model(arch, root / "hf", seed=3)
    folder = write_gguf(hf, root / "gguf", arch, qtype)
    return folder, folder.with_name("gguf-fp32")


def test_the_loaded_weights_are_the_files_dequantized_in_transformers_order(
    gguf_model: tuple[Path, Path],
) -> None:
    folder, twin = gguf_model
    model = load_gguf_model(folder, folder / "model.gguf", "sdpa")
    reference = load_file(twin / "model.safetensors")
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert "model.layers.0.self_attn.q_proj" in quantized and "model.embed_tokens" in quantized
    for name, module in quantized.items():
        assert torch.equal(module.weight_q.dequantize(), reference[name + ".weight"]), name
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_greedy_tokens_equal_the_fp32_engine_on_the_dequantized_weights(
    gguf_model: tuple[Path, Path],
) -> None:
    folder, twin = gguf_model
    prompts = [p for p, _ in exactness_workload(seed=5)[:8]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), kv_cache_memory=8 << 20, quantized_matmul="float32")
    kinds = {type(m).__name__ for m in llm.engine.runner.model.modules()}
    assert "QuantPanelLinear" in kinds and "QuantLinear" not in kinds  # every linear on the C++ kernel
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
    # each half of each layer is one C++ op over the quantized panels (biases ride along)
    assert layers and all(
        layer.attention_input_args is not None and layer.mlp_args is not None for layer in layers
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    want = LLM(str(twin), kv_cache_memory=8 << 20).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_gguf_model_refuses_other_dtypes_by_name(gguf_model: tuple[Path, Path]) -> None:
    folder, _ = gguf_model
    with pytest.raises(ValueError, match=r"GGUF model .* runs on the CPU with float32 activations"):
        LLM(str(folder), dtype="bfloat16", kv_cache_memory=8 << 20)


def test_unreadable_files_are_refused_with_one_message(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(GgufError, match=r"truncated.gguf is not a readable GGUF file"):
        check_gguf(truncated)
    with pytest.raises(GgufError, match="no such GGUF file"):
        gguf_model_folder(tmp_path / "missing.gguf", store=tmp_path)


def _writer(path: Path, arch: str) -> GGUFWriter:
    return GGUFWriter(str(path), arch)


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unsupported_architecture_or_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2.gguf"
    writer = _writer(gpt2, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(writer)
    with pytest.raises(
        GgufError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"
    ):
        check_gguf(gpt2)
    q5 = tmp_path / "q5.gguf"
    writer = _writer(q5, "llama")
    raw = quants.quantize(np.zeros((4, 32), np.float32), GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q5_0)
    _finish(writer)
    with pytest.raises(GgufError, match=r"tensor 'blk.0.attn_q.weight' is Q5_0; supported types are Q8_0"):
        check_gguf(q5)


def test_the_cli_refuses_a_corrupt_file_with_exit_1_and_no_traceback(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all" * 10)
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve", "dataplane", "--model", str(corrupt), "--port", "0",
         "--model-home", str(tmp_path / "store")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "corrupt.gguf is not a readable GGUF file" in proc.stderr
