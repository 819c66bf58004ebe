// Row kernels for the elementwise work between a decoder layer's matmuls (what each computes
// and how it compares with transformers: layer_ops.cpp), and the checks their ops share.
//
// Shared by layer_ops.cpp (one op per kernel) and decoder_block.cpp (a decoder layer's steps
// chained in one op). Internal to the extension: everything is in an unnamed namespace, so
// each source gets its own inlined copy. The including source defines TORCH_TARGET_VERSION and
// includes torch's stable headers first.
#pragma once

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

// Below ~32k elements one thread finishes before a second would have started.
constexpr int64_t kGrainElements = 32768;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

inline void check_rows(const torch::stable::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  STD_TORCH_CHECK(t.is_cpu() && t.scalar_type() == torch::headeronly::ScalarType::Float, name, " must be a float32 CPU tensor");
  STD_TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "]");
  STD_TORCH_CHECK(t.stride(1) == 1, name, " needs a contiguous last dim");
}

inline void check_weight(const torch::stable::Tensor& weight, int64_t n) {
  STD_TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == torch::headeronly::ScalarType::Float && weight.dim() == 1 &&
                      weight.size(0) == n && weight.is_contiguous(),
                  "weight must be a contiguous float32 [", n, "]");
}

// The normalised, weighted row: out = w * (x * inv), inv = 1 / sqrt(sum(x^2) / n + eps).
// 16 floats at a time as native parts (vec.h kHalves), the sum of squares folded as hsum.
inline void norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  int64_t i = 0;
  vnat acc[kHalves] = {};
  for (; i + kW <= n; i += kW) {
    for (int h = 0; h < kHalves; ++h) {
      const vnat v = load_nat(x + i + h * kNW);
      acc[h] += v * v;
    }
  }
  float sum = hsum_parts(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const vnat vinv = splat_nat(inv);
  for (i = 0; i + kW <= n; i += kW) {
    for (int h = 0; h < kHalves; ++h) {
      const int64_t j = i + h * kNW;
      store_nat(out + j, load_nat(w + j) * (load_nat(x + j) * vinv));
    }
  }
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// residual += delta over one row of n floats (the same IEEE adds as torch's in-place add).
inline void add_row(float* residual, const float* delta, int64_t n) {
  int64_t i = 0;
  for (; i + kNW <= n; i += kNW) store_nat(residual + i, load_nat(residual + i) + load_nat(delta + i));
  for (; i < n; ++i) residual[i] += delta[i];
}

// out[i] = silu(gate[i]) * up[i] for i < inter, where up = gate + inter (gate and up side by side).
inline void silu_mul_row(float* out, const float* gate, int64_t inter) {
  const float* up = gate + inter;
  int64_t i = 0;
  for (; i + kW <= inter; i += kW) {
    for (int h = 0; h < kHalves; ++h) {
      const int64_t j = i + h * kNW;
      const vnat x = load_nat(gate + j);
      // silu(x) = x / (1 + exp(-x)), as torch computes it; then times up.
      store_nat(out + j, x / (1.0f + exp_clamped(-x)) * load_nat(up + j));
    }
  }
  for (; i < inter; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// For d < D/2: x[d] * cos[d] - x[d + D/2] * sin[d]; for d >= D/2: x[d] * cos[d] + x[d - D/2]
// * sin[d]. transformers computes x * cos + cat(-x2, x1) * sin: the same products and sums
// ((-a) * b == -(a * b) and c + -(e) == c - e exactly), so no FMA may fuse them.
PAGEDSERVE_NO_FP_CONTRACT inline void rotate_row(float* x, const float* c, const float* s, int64_t half) {
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


inline void check_rotary_tables(const torch::stable::Tensor& cos, const torch::stable::Tensor& sin, int64_t tokens,
                                int64_t dim) {
  for (const torch::stable::Tensor* t : {&cos, &sin}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == torch::headeronly::ScalarType::Float && t->dim() == 2 &&
                        t->size(0) == tokens && t->size(1) == dim && t->is_contiguous(),
                    "cos and sin must be contiguous float32 [", tokens, ", ", dim, "]");
  }
}

// Rotary over `heads` heads of `tokens` rows: head h of token t at qk + t * ts + h * hs;
// cos, sin: [tokens, dim] contiguous.
inline void rotate_heads(float* qk, int64_t ts, int64_t hs, int64_t tokens, int64_t heads, const float* cos,
                         const float* sin, int64_t dim) {
  torch::stable::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) rotate_row(qk + t * ts + h * hs, cos + t * dim, sin + t * dim, dim / 2);
    }
  });
}

// out[r] = silu(gate_up[r][:inter]) * gate_up[r][inter:] for `rows` rows (row strides os, gs).
inline void silu_mul_rows(float* out, int64_t os, const float* gate_up, int64_t gs, int64_t rows, int64_t inter) {
  torch::stable::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(out + r * os, gate_up + r * gs, inter);
  });
}

// out[r] = rms_norm(x[r]) for `rows` rows of n floats (row strides os, xs).
inline void norm_rows(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t rows, int64_t n,
                      float eps) {
  torch::stable::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(out + r * os, x + r * xs, w, n, eps);
  });
}

}  // namespace
