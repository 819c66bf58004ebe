// CPU fp32 kernels for the elementwise work between a decoder layer's matmuls.
//
// Why: in a decode step of a small model the work between the matmuls is a few kilobytes
// per row, and torch runs it as chains of small ops (RMSNorm alone is pow, mean, add,
// rsqrt, mul, mul), each a dispatch, an allocation and a pass over memory. Measured on the
// default model (64 rows, 2 threads) those chains cost ~15 % of a decode step. Each op here
// is one pass:
//
//   rms_norm(out, x, weight, eps):                out = weight * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(out, residual, delta, weight, eps): residual += delta, then
//                                                 out = rms_norm(residual) (residual in place)
//   silu_and_mul(out, gate_up):                   out = silu(gate_up[:, :I]) * gate_up[:, I:]
//   rotary_neox(qk, cos, sin):                    qk = qk * cos + rotate_half(qk) * sin, in place
//
// x, residual, delta, gate_up, out: [T, N] float32 with the last dim contiguous (any row
// stride); weight: [N]; qk: [T, heads, D] (head_dim contiguous); cos, sin: [T, D] contiguous.
//
// Results against transformers' modules: the residual add and the rotary are the same IEEE
// operations in the same order (rotary is compiled without FMA contraction for that), so
// they are bit-identical; RMSNorm's sum of squares runs in a different order (~1 ulp) and
// SiLU's exp is a polynomial (~1 ulp, vec.h), so those differ in the last bits.
//
// Parallelism: torch's intra-op threads over rows (torch::stable::parallel_for), only when a
// call has enough elements to pay for waking them (kGrainElements).
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

#include "row_ops.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) {
  const int64_t rows = x.size(0);
  const int64_t n = x.dim() == 2 ? x.size(1) : 0;
  check_rows(x, "x", rows, n);
  check_rows(out, "out", rows, n);
  check_weight(weight, n);
  norm_rows(out.mutable_data_ptr<float>(), out.stride(0), x.const_data_ptr<float>(), x.stride(0),
            weight.const_data_ptr<float>(), rows, n, static_cast<float>(eps));
}

void add_rms_norm(Tensor out, Tensor residual, Tensor delta, Tensor weight, double eps) {
  const int64_t rows = residual.size(0);
  const int64_t n = residual.dim() == 2 ? residual.size(1) : 0;
  check_rows(residual, "residual", rows, n);
  check_rows(delta, "delta", rows, n);
  check_rows(out, "out", rows, n);
  check_weight(weight, n);
  float* rp = residual.mutable_data_ptr<float>();
  const float* dp = delta.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  const int64_t rs = residual.stride(0), ds = delta.stride(0), os = out.stride(0);
  const float e = static_cast<float>(eps);
  torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * rs;
      add_row(res, dp + r * ds, n);
      norm_row(op + r * os, res, wp, n, e);
    }
  });
}

void silu_and_mul(Tensor out, Tensor gate_up) {
  const int64_t rows = gate_up.size(0);
  const int64_t two_i = gate_up.dim() == 2 ? gate_up.size(1) : 0;
  STD_TORCH_CHECK(two_i % 2 == 0, "gate_up's last dim must be even (gate and up side by side)");
  const int64_t inter = two_i / 2;
  check_rows(gate_up, "gate_up", rows, two_i);
  check_rows(out, "out", rows, inter);
  silu_mul_rows(out.mutable_data_ptr<float>(), out.stride(0), gate_up.const_data_ptr<float>(), gate_up.stride(0),
                rows, inter);
}

void rotary_neox(Tensor qk, Tensor cos, Tensor sin) {
  STD_TORCH_CHECK(qk.is_cpu() && qk.scalar_type() == ScalarType::Float && qk.dim() == 3,
                  "qk must be a float32 CPU [T, heads, D]");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  STD_TORCH_CHECK(qk.stride(2) == 1, "qk needs a contiguous head_dim");
  STD_TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  check_rotary_tables(cos, sin, tokens, dim);
  rotate_heads(qk.mutable_data_ptr<float>(), qk.stride(0), qk.stride(1), tokens, heads, cos.const_data_ptr<float>(),
               sin.const_data_ptr<float>(), dim);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor delta, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_neox(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));
  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  m.impl("rotary_neox", TORCH_BOX(&rotary_neox));
}
