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

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

#if defined(__clang__)
#define PAGEDSERVE_NO_FP_CONTRACT
#define PAGEDSERVE_NO_FP_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define PAGEDSERVE_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#define PAGEDSERVE_NO_FP_CONTRACT_BODY
#endif

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Below ~32k elements one thread finishes before a second would have started.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  STD_TORCH_CHECK(t.is_cpu() && t.scalar_type() == ScalarType::Float, name, " must be a float32 CPU tensor");
  STD_TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "]");
  STD_TORCH_CHECK(t.stride(1) == 1, name, " needs a contiguous last dim");
}

void check_weight(const Tensor& weight, int64_t n) {
  STD_TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == ScalarType::Float && weight.dim() == 1 &&
                      weight.size(0) == n && weight.is_contiguous(),
                  "weight must be a contiguous float32 [", n, "]");
}

// The normalised, weighted row: out = w * (x * inv), inv = 1 / sqrt(sum(x^2) / n + eps).
inline void norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  int64_t i = 0;
  vfloat acc = splat(0.0f);
  for (; i + kW <= n; i += kW) {
    const vfloat v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const vfloat vinv = splat(inv);
  for (i = 0; i + kW <= n; i += kW) store(out + i, load(w + i) * (load(x + i) * vinv));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) {
  const int64_t rows = x.size(0);
  const int64_t n = x.dim() == 2 ? x.size(1) : 0;
  check_rows(x, "x", rows, n);
  check_rows(out, "out", rows, n);
  check_weight(weight, n);
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float e = static_cast<float>(eps);
  torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(op + r * os, xp + r * xs, wp, n, e);
  });
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
      const float* d = dp + r * ds;
      int64_t i = 0;
      for (; i + kW <= n; i += kW) store(res + i, load(res + i) + load(d + i));
      for (; i < n; ++i) res[i] += d[i];
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
  const float* gp = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  const vfloat one = splat(1.0f);
  torch::stable::parallel_for(0, rows, grain_rows(two_i), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + inter;
      float* o = op + r * os;
      int64_t i = 0;
      for (; i + kW <= inter; i += kW) {
        const vfloat x = load(g + i);
        // silu(x) = x / (1 + exp(-x)), as torch computes it; then times up.
        store(o + i, x / (one + exp_clamped(-x)) * load(u + i));
      }
      for (; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

// For d < D/2: x[d] * cos[d] - x[d + D/2] * sin[d]; for d >= D/2: x[d] * cos[d] + x[d - D/2]
// * sin[d]. transformers computes x * cos + cat(-x2, x1) * sin: the same products and sums
// ((-a) * b == -(a * b) and c + -(e) == c - e exactly), so no FMA may fuse them.
PAGEDSERVE_NO_FP_CONTRACT void rotate_row(float* x, const float* c, const float* s, int64_t half) {
  PAGEDSERVE_NO_FP_CONTRACT_BODY
  int64_t d = 0;
  for (; d + kW <= half; d += kW) {
    const vfloat x1 = load(x + d), x2 = load(x + half + d);
    const vfloat a = x1 * load(c + d);
    const vfloat b = x2 * load(s + d);
    const vfloat e = x2 * load(c + half + d);
    const vfloat f = x1 * load(s + half + d);
    store(x + d, a - b);
    store(x + half + d, e + f);
  }
  for (; d < half; ++d) {
    const float x1 = x[d], x2 = x[half + d];
    const float a = x1 * c[d];
    const float b = x2 * s[d];
    const float e = x2 * c[half + d];
    const float f = x1 * s[half + d];
    x[d] = a - b;
    x[half + d] = e + f;
  }
}

void rotary_neox(Tensor qk, Tensor cos, Tensor sin) {
  STD_TORCH_CHECK(qk.is_cpu() && qk.scalar_type() == ScalarType::Float && qk.dim() == 3,
                  "qk must be a float32 CPU [T, heads, D]");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  STD_TORCH_CHECK(qk.stride(2) == 1, "qk needs a contiguous head_dim");
  STD_TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  for (const Tensor* t : {&cos, &sin}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float && t->dim() == 2 &&
                        t->size(0) == tokens && t->size(1) == dim && t->is_contiguous(),
                    "cos and sin must be contiguous float32 [", tokens, ", ", dim, "]");
  }
  float* qp = qk.mutable_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  const int64_t ts = qk.stride(0), hs = qk.stride(1);
  torch::stable::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) rotate_row(qp + t * ts + h * hs, cp + t * dim, sp + t * dim, dim / 2);
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor delta, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_neox(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));
  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  m.impl("rotary_neox", TORCH_BOX(&rotary_neox));
}
