"""GGUF files made from a model's fp32 weights, for the quantized-weights benchmarks and tests.

`write_gguf_like(template, weights, dst, type_name)` writes `weights` (a Hugging Face state
dict, transformers' tensor names and row order) as a GGUF file with the metadata (architecture,
hyper-parameters, tokenizer, chat template) of `template`, an existing GGUF of the same
model: every 2-D weight quantized to `type_name` (K-quants: where its rows are whole
super-blocks, else K_QUANT_FALLBACK), the rest float32, q/k rows in llama.cpp's
order for the llama architecture. The `gguf` package quantizes Q8_0, Q4_0 and Q4_1; it has no
Q4_K quantizer, so `quantize_q4_k` here makes one the plain way (per 32-weight sub-block min and
scale, 6-bit sub-block scales and mins per 256-weight super-block), enough for test data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagedserve.dataplane.runner.gguf_loader import TENSOR_NAMES, rotary_row_order

_HF_TO_GGUF = {hf: gguf for gguf, hf in TENSOR_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """transformers' tensor name -> GGUF's ("model.layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight")."""
    module, _, kind = hf_name.rpartition(".")
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        key = ".".join([*parts[:2], "{i}", *parts[3:]])
        return _HF_TO_GGUF[key].replace("{i}", parts[2]) + "." + kind
    return _HF_TO_GGUF[module] + "." + kind


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32 (k a multiple of 256) -> Q4_K blocks, [rows, k / 256 * 144] bytes."""
    rows, k = weight.shape
    x = weight.astype(np.float32).reshape(-1, 8, 32)  # super-blocks x sub-blocks x weights
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 15.0  # per sub-block: weight ~ q * scale - min
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.rint(mins / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]
        q = np.where(step > 0, np.rint((x + (dmin32 * mn)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1
    )
    return blocks.reshape(rows, k // 256 * 144)


# What a row that is not a whole number of 256-weight super-blocks gets in a K-quant file
# (SmolLM2's 576 inputs): llama.cpp falls back to another type for such tensors too.
K_QUANT_FALLBACK = "Q8_0"


def stored_type(type_name: str, in_features: int) -> str:
    """The type a weight of `in_features` inputs is written in, for a file of `type_name`."""
    return K_QUANT_FALLBACK if type_name.endswith("_K") and in_features % 256 else type_name


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if type_name == "Q4_K":
        return quantize_q4_k(weight)
    return np.asarray(quants.quantize(weight, GGMLQuantizationType[type_name]))


def write_gguf_like(template: Path, weights: dict[str, torch.Tensor], dst: Path, type_name: str) -> Path:
    """`weights` as a GGUF file at `dst` with `template`'s metadata, 2-D weights in `type_name`."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(template))
    arch = str(reader.fields["general.architecture"].contents())
    heads = {
        "q_proj": int(reader.fields[f"{arch}.attention.head_count"].contents()),
        "k_proj": int(reader.fields[f"{arch}.attention.head_count_kv"].contents()),
    }
    writer = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for name, tensor in weights.items():
        if (
            name == "lm_head.weight"
            and "model.embed_tokens.weight" in weights
            and torch.equal(tensor, weights["model.embed_tokens.weight"])
        ):
            continue  # tied: the file has the embedding only, as llama.cpp writes it
        data = tensor.detach().to(torch.float32).numpy()
        heads_of = heads.get(name.split(".")[-2]) if arch == "llama" else None
        if heads_of is not None:
            data = data[np.argsort(rotary_row_order(data.shape[0], heads_of).numpy())]
        if data.ndim == 2:
            stored = stored_type(type_name, data.shape[1])
            writer.add_tensor(gguf_name(name), quantize(data, stored), raw_dtype=GGMLQuantizationType[stored])
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
