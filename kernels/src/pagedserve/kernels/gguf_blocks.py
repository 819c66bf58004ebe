"""GGUF quantized blocks -> QuantizedWeight (kernels/src/pagedserve/kernels/quant.py), without de-quantizing.

A GGUF tensor of a quantized type is, per row (one output feature), a run of blocks; each
format's block holds its values and float16 scales (ggml's ggml-common.h, and the `gguf`
package's numpy de-quantizers, which these follow). Each becomes the one form the kernel
serves, weight = value * scale (+ min) per group of inputs:

| format | block | values | group | scale | min |
|---|---|---|---|---|---|
| Q8_0 | 34 B / 32 | int8 q | 32 | d | - |
| Q4_0 | 18 B / 32 | q 0..15 | 32 | d | -8 d |
| Q4_1 | 20 B / 32 | q 0..15 | 32 | d | m |
| Q4_K | 144 B / 256 | q 0..15 | 32 | d * sc (6-bit) | -(dmin * m) (6-bit m) |
| Q6_K | 210 B / 256 | q - 32, int8 | 16 | d * sc (int8) | - |

Every product value * scale is exact in float32 where a min follows (a 4-bit value times
at most 17 significant bits), so the de-quantized weights equal the `gguf` package's
float32 ones bit for bit (a test checks each format). Q6_K keeps its 6-bit values one per
byte (8 bits per weight instead of 6.5: the kernel's 8-bit path).

Other types (Q5_*, Q2_K, Q3_K, Q5_K, IQ*, ...) raise UnsupportedTensorType naming the tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels.quant import QuantizedWeight

# Block sizes in bytes and weights, per supported format.
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q4_K": (144, 256),
    "Q6_K": (210, 256),
}
SUPPORTED_TYPES = tuple(BLOCKS)


class UnsupportedTensorType(ValueError):
    """A GGUF tensor's type has no kernel here."""


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float32 (the block's float16 field)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values: byte j holds value j (low) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].view(np.int8), d[:, None], None, 32


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d[:, None], (-8.0 * d)[:, None].astype(np.float32), 32


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]), d[:, None], m[:, None], 32


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    # 12 bytes of 6-bit scales and mins for the 8 sub-blocks (ggml's get_scale_min_k4)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d[:, None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
    mins = -(dmin[:, None] * mn.astype(np.float32))
    # 128 bytes: 4 chunks of 32; chunk c's low nibbles are sub-block 2c, its high ones 2c + 1
    qs = blocks[:, 16:].reshape(n, 4, 32)
    values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return values, scales, mins, 32


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    values = (low.reshape(n, 2, 4, 32) | (high.reshape(n, 2, 4, 32) << 4)).astype(np.int16) - 32
    return values.reshape(n, 256).astype(np.int8), d[:, None] * sc, None, 16


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decode_blocks(
    name: str, type_name: str, data: np.ndarray, out_features: int, in_features: int
) -> QuantizedWeight:
    """The GGUF tensor `name` of `type_name` (raw bytes, [out_features, bytes per row]) as a
    QuantizedWeight [out_features, in_features]."""
    decoder = _DECODERS.get(type_name)
    if decoder is None:
        raise UnsupportedTensorType(
            f"tensor {name!r} is {type_name}; supported quantized types are {', '.join(SUPPORTED_TYPES)} "
            "(and F32 / F16 / BF16)"
        )
    block_bytes, block_weights = BLOCKS[type_name]
    if in_features % block_weights:
        raise ValueError(f"tensor {name!r}: {in_features} inputs is not a whole number of {type_name} blocks")
    blocks_per_row = in_features // block_weights
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size != out_features * blocks_per_row * block_bytes:
        raise ValueError(
            f"tensor {name!r}: {raw.size} bytes, but {out_features} x {in_features} {type_name} needs "
            f"{out_features * blocks_per_row * block_bytes}"
        )
    values, scales, mins, group = decoder(raw.reshape(-1, block_bytes))
    groups = in_features // group
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(values).reshape(out_features, in_features)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out_features, groups)),
        None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(out_features, groups)),
        group,
        type_name,
    )
