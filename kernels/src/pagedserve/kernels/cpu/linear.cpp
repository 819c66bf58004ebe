// CPU fp32 linear layer over a weight packed once into column panels.
//
// Op: pagedserve_cpu::panel_linear(out, x, packed, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, K, 32] float32, contiguous: panel p holds output columns 32p .. 32p+31 of
//           the nn.Linear weight [N, K], transposed so one k step of a panel is 32 adjacent
//           floats (kernels/src/pagedserve/kernels/linear.py pack_panels; columns past N are zero)
//   bias:   [N] float32, or an empty tensor for none
//   out:    [M, N] float32, contiguous (written)
//
// Why: at decode row counts (M = 1 .. 64) a step streams every weight once from DRAM, and
// MKL / oneDNN reach 40-80 % of this machine's sgemm peak there (measured on the default
// model's shapes, 2 threads). Here a panel's 32 columns x all of K (74 KB at K = 576) is read
// from memory once, with software prefetch ahead of the k loop, and then stays in L2 while
// every row block of x runs over it: a 12 x 32 register tile (24 accumulators of 16 floats
// on AVX-512), one broadcast of x and two FMAs per row and k. Measured on the default
// model's decode shapes: 1.2-1.6x oneDNN's packed linear at 8-34 rows.
//
// Results: each output element is one fused multiply-add chain over k = 0 .. K-1 in order,
// plus the bias, computed by one thread. So a row's result does not depend on the other rows
// in the call, on the row's position or on the thread count (batch-invariant), and differs
// from MKL's and oneDNN's blocked sums only by accumulation order (~1e-6 relative).
//
// Parallelism: torch's intra-op threads over (panel, row chunk) items; consecutive items of
// a thread share a panel, so its weights are read from memory once per thread.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

#include "panel.h"

namespace {

using torch::stable::Tensor;

void panel_linear(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  panel_matmul(panel_problem("panel_linear", out, x, packed, bias), /*accumulate=*/false);
}

// The output columns per panel of this build, for kernels/src/pagedserve/kernels/linear.py's pack_panels.
int64_t panel_width() { return kPanel; }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
  m.def("panel_width() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("panel_linear", TORCH_BOX(&panel_linear)); }

// No tensor argument to dispatch on: the width is registered for every dispatch key.
STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CompositeExplicitAutograd, m) {
  m.impl("panel_width", TORCH_BOX(&panel_width));
}
