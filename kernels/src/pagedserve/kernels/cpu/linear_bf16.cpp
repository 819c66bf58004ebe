// CPU linear layer over a bf16 weight packed once into column panels; x, bias, out float32.
//
// Op: pagedserve_cpu::panel_linear_bf16(out, x, packed, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, ceil(K / 2), W, 2] bfloat16, contiguous, W = panel_width(): panel p holds
//           output columns W p .. W p + W - 1, and each (k pair, column) holds the column's
//           weights at inputs 2j, 2j + 1 (kernels/src/pagedserve/kernels/linear.py pack_panels_bf16; columns past N
//           and the input past an odd K are zero)
//   bias:   [N] float32, or an empty tensor for none
//   out:    [M, N] float32, contiguous (written)
//
// Why: decode streams every weight once per step; bf16 weights are half the bytes of fp32.
// Where the CPU has AVX-512 BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+), x is rounded to
// bf16 (nearest even) and each instruction (vdpbf16ps) does two multiply-adds per lane, so
// the compute is twice fp32's as well; accumulation is fp32. Elsewhere the weights are
// widened in registers (a shift: bf16 is fp32's top half) and multiplied with the fp32 x by
// FMAs, so only the bytes are saved and x is not rounded.
//
// Results: one output element is one in-order chain over the k pairs, plus the bias, by one
// thread: a row's result does not depend on the other rows, its position or the thread count.
// They differ from the fp32 layer by the bf16 rounding of the weight (and of x with
// AVX-512 BF16): ~2^-9 relative per product.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "panel_bf16.h"

namespace {

using torch::stable::Tensor;

void panel_linear_bf16(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  panel_matmul_bf16(panel_problem_bf16("panel_linear_bf16", out, x, packed, bias), /*accumulate=*/false);
}

bool bf16_dot_products() { return kBf16DotProducts; }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("panel_linear_bf16(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
  m.def("bf16_dot_products() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("panel_linear_bf16", TORCH_BOX(&panel_linear_bf16)); }

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CompositeExplicitAutograd, m) {
  m.impl("bf16_dot_products", TORCH_BOX(&bf16_dot_products));
}
