// CPU linear layer over quantized weights kept quantized in memory, in column panels.
//
// Op: pagedserve_cpu::quant_panel_linear(out, x, packed, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, B] contiguous bytes, one row per panel of W output columns (W = the panel
//           width: 32 AVX-512, 16 AVX2, 8 portable; kernels/quant.py pack_quant_panels), the
//           G groups of K/G inputs one after the other, each:
//           - uint8: 4-bit values with mins. K/G x W/2 bytes of values in the fp32 panels'
//             order (kernels/cpu/panel.h), one k step after the other, byte j holding column j
//             (low nibble) and column j + W/2 (high nibble), values 0 .. 15; then the group's
//             float32 scales [W], then its float32 mins [W]
//           - int8: K/G x W signed 8-bit values, then the group's float32 scales [W]; no mins
//           G follows from B and K. One stream per panel: the k loop reads it front to back,
//           so the prefetch ahead of the values covers the scales too (scales kept apart at the
//           panel's end missed the cache once a group: 10 GB/s instead of the memory's 30).
//   bias:   [N] float32, or an empty tensor for none
//   out:    [M, N] float32, contiguous (written)
//
// Weight (column c, input k) = value * scale (+ min) of its group, computed in registers as the
// k loop reaches it: a k step reads W/2 or W bytes instead of the fp32 panel's 4W, which is
// what bounds a decode step at small batches (every weight is read once per step).
// The GGUF formats this serves (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) all reduce to this form
// (kernels/gguf_blocks.py), and each has value * scale exact in fp32 where a min follows
// (4-bit values times a scale of at most 17 significant bits), so value * scale + min, one
// FMA, rounds exactly once, as the reference de-quantization (kernels/quant.py dequantize)
// does: the result is then bit-identical to panel_linear on the de-quantized weight, one
// in-order FMA chain over k per output element, batch-invariant like it.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "panel_quant.h"

namespace {

using torch::stable::Tensor;

void quant_panel_linear(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  quant_matmul(quant_problem("quant_panel_linear", out, x, packed, bias), /*accumulate=*/false);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("quant_panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("quant_panel_linear", TORCH_BOX(&quant_panel_linear)); }
