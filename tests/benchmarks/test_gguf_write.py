"""The Q4_K test-data quantizer (benchmarks/src/pagedserve/benchmarks/gguf_write.py) writes blocks that the `gguf` package
and our decoder read alike, close to the weights; and the tensor-name map is the loader's inverse."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pagedserve.benchmarks.gguf_write import gguf_name, quantize_q4_k, stored_type
from pagedserve.dataplane.runner.gguf_loader import module_path
from pagedserve.kernels.gguf_blocks import decode_blocks


def test_q4_k_blocks_decode_alike_and_close_to_the_weights() -> None:
    weight = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.05
    blocks = quantize_q4_k(weight)
    assert blocks.shape == (16, 2 * 144) and blocks.dtype == np.uint8
    theirs = quants.dequantize(blocks, GGMLQuantizationType.Q4_K)
    ours = decode_blocks("w", "Q4_K", blocks, 16, 512).dequantize().numpy()
    assert np.array_equal(ours, theirs)
    # 4 bits over each 32-weight sub-block's range: rms error well under a tenth of the spread
    assert np.sqrt(((theirs - weight) ** 2).mean()) < 0.1 * weight.std()


def test_rows_that_are_not_whole_super_blocks_fall_back() -> None:
    assert stored_type("Q4_K", 1536) == "Q4_K"
    assert stored_type("Q4_K", 576) == "Q8_0"
    assert stored_type("Q4_1", 576) == "Q4_1"


@pytest.mark.parametrize(
    "hf_name",
    ["model.embed_tokens.weight", "model.layers.7.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
     "model.layers.3.self_attn.k_proj.bias", "model.norm.weight", "lm_head.weight"],
)  # fmt: skip
def test_the_name_map_is_the_loaders_inverse(hf_name: str) -> None:
    module, _, kind = hf_name.rpartition(".")
    assert module_path(gguf_name(hf_name)) == (module, kind)
