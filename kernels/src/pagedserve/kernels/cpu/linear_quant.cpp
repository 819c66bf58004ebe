// CPU linear layer over quantized weights kept quantized in memory, in column panels.
//
// Op: pagedserve_cpu::quant_panel_linear(out, x, packed, bias, int8_activations=False) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, G, B] contiguous bytes, one row per panel of W output columns (W = the panel
//           width: 32 AVX-512, 16 AVX2, 8 portable; kernels/src/pagedserve/kernels/quant.py pack_quant_panels), the
//           G groups of K/G inputs (a multiple of 4) one after the other, each B bytes: its
//           values in chunks of 4 k steps, then its scales [W] (and for 4-bit its mins [W]),
//           float16 or float32 (which one follows from B; float16 where the weight's scales
//           are float16 exactly, as GGUF Q8_0 / Q4_0 / Q4_1 store them: 0.625 bytes per
//           4-bit weight instead of 0.75). In a chunk a 32-bit lane holds one column's values
//           at the 4 k steps, byte i for step i (the operand shape of vpdpbusd / vpmaddubsw):
//           - uint8: 4-bit values (0 .. 15) with mins, W/2 lanes: lane c holds column c in
//             its bytes' low nibbles and column c + W/2 in their high nibbles
//           - int8: 8-bit signed values, no mins, W lanes: lane c holds column c
//           One stream per panel: the k loop reads it front to back, so the prefetch ahead of
//           the values covers the scales too (scales kept apart at the panel's end missed the
//           cache once a group: 10 GB/s instead of the memory's 30).
//   int8_activations: multiply by integer dot products over x rounded to int8 per block of
//           (up to) 32 inputs (panel_quant.h); else in floats, as below. Groups of neither
//           at most 32 nor a multiple of 32 inputs stay in floats.
//
// In floats, weight (column c, input k) = value * scale (+ min) of its group, computed in
// registers as the k loop reaches it: a k step reads W/2 or W bytes instead of the fp32 panel's
// 4W, which is what bounds a decode step at small batches (every weight is read once per step).
// The GGUF formats this serves (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) all reduce to this form
// (kernels/src/pagedserve/kernels/gguf_blocks.py), and each has value * scale exact in fp32 where a min follows
// (4-bit values times a scale of at most 17 significant bits), so value * scale + min, one
// FMA, rounds exactly once, as the reference de-quantization (kernels/src/pagedserve/kernels/quant.py dequantize)
// does: the result is then bit-identical to panel_linear on the de-quantized weight, one
// in-order FMA chain over k per output element, batch-invariant like it.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "panel_quant.h"

namespace {

using torch::stable::Tensor;

void quant_panel_linear(Tensor out, Tensor x, Tensor packed, Tensor bias, bool int8_activations) {
  quant_matmul(quant_problem("quant_panel_linear", out, x, packed, bias, int8_activations), /*accumulate=*/false);
}

// How this build sums the integer products (panel_quant.h kIntDotProducts, numbered as
// kernels/src/pagedserve/kernels/cpu_ext.py INT8_DOT_PRODUCTS), for logs and tests.
int64_t quant_int_dot_products() { return kIntDotProducts; }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("quant_panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias, bool int8_activations=False) -> ()");
  m.def("quant_int_dot_products() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("quant_panel_linear", TORCH_BOX(&quant_panel_linear)); }

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CompositeExplicitAutograd, m) {
  m.impl("quant_int_dot_products", TORCH_BOX(&quant_int_dot_products));
}
