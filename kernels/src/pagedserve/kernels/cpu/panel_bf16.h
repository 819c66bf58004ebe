// The bf16-weight panel matmul: out (=|+=) x @ weight.T + bias, x and out float32, the weight
// rounded to bfloat16 and packed once into column panels of k pairs (layout and rationale:
// linear_bf16.cpp). Shared by linear_bf16.cpp (the panel_linear_bf16 op) and decoder_block.cpp
// (a decoder layer's matmuls chained in one op), like panel.h for fp32 weights.
//
// Where the CPU has AVX-512 BF16, x is rounded to bf16 (nearest even) once per call and each
// vdpbf16ps does two multiply-adds per lane; elsewhere the weights are widened in registers
// and multiplied with the fp32 x by FMAs. One output element is one in-order chain over the
// k pairs, plus the bias; `accumulate` adds it to what out holds (out + (acc + bias), the
// order of `out += linear(x)`), so the fused layers are bit-identical to the separate ops.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "panel.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_DPBF16 1
#endif

namespace {

typedef uint32_t vnat_u __attribute__((vector_size(kNW * sizeof(uint32_t))));

// out[0:cols] = row[0:cols], or += with `accumulate`.
inline void store_row(float* out, const float* row, int64_t cols, bool accumulate) {
  if (accumulate) {
    for (int64_t c = 0; c < cols; ++c) out[c] = out[c] + row[c];
  } else {
    std::copy(row, row + cols, out);
  }
}

// One tile: R rows of x against one panel of `pairs` k pairs. xs is x as the kernel reads it:
// bf16 pairs packed in 32 bits [R][pairs] (AVX-512 BF16), or fp32 [R][ldx] otherwise.
template <int R>
inline void tile_bf16(const void* xs, int64_t ldx, const uint32_t* panel, int64_t pairs, int64_t k_len,
                      const float* bias, float* out, int64_t ldo, int64_t cols, bool accumulate) {
#ifdef PAGEDSERVE_DPBF16
  const uint32_t* xp = static_cast<const uint32_t*>(xs);
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t* b = panel + j * kPanel;
    __builtin_prefetch(b + kPrefetchSteps * kPanel, 0, 1);
    if constexpr (kPanel * sizeof(uint32_t) > 64) __builtin_prefetch(b + kPrefetchSteps * kPanel + 16, 0, 1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + kNW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * ldx + j]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
  float padded[kPanel] = {};
  if (bias != nullptr) std::copy(bias, bias + cols, padded);
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    _mm512_storeu_ps(row, _mm512_add_ps(acc0[r], _mm512_loadu_ps(padded)));
    _mm512_storeu_ps(row + kNW, _mm512_add_ps(acc1[r], _mm512_loadu_ps(padded + kNW)));
    store_row(out + r * ldo, row, cols, accumulate);
  }
  (void)k_len;
#else
  const float* x = static_cast<const float*>(xs);
  const vnat_u high = vnat_u{} + 0xFFFF0000u;
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = splat_nat(0.0f);
  const int64_t full = k_len / 2;  // pairs whose odd input exists in x
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t* b = panel + j * kPanel;
    __builtin_prefetch(b + kPrefetchSteps * kPanel, 0, 1);
    if constexpr (kPanel * sizeof(uint32_t) > 64) __builtin_prefetch(b + kPrefetchSteps * kPanel + 16, 0, 1);
    vnat_u u0, u1;
    std::memcpy(&u0, b, sizeof(u0));
    std::memcpy(&u1, b + kNW, sizeof(u1));
    // Lane c: low half the weight at input 2j, high half at 2j + 1; bf16 is fp32's top half.
    const vnat_u e0 = u0 << 16, o0 = u0 & high, e1 = u1 << 16, o1 = u1 & high;
    vnat we0, wo0, we1, wo1;
    std::memcpy(&we0, &e0, sizeof(we0));
    std::memcpy(&wo0, &o0, sizeof(wo0));
    std::memcpy(&we1, &e1, sizeof(we1));
    std::memcpy(&wo1, &o1, sizeof(wo1));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + 2 * j;
      const vnat a = splat_nat(xr[0]);
      acc0[r] = acc0[r] + a * we0;
      acc1[r] = acc1[r] + a * we1;
      if (j < full) {
        const vnat c = splat_nat(xr[1]);
        acc0[r] = acc0[r] + c * wo0;
        acc1[r] = acc1[r] + c * wo1;
      }
    }
  }
  float padded[kPanel] = {};
  if (bias != nullptr) std::copy(bias, bias + cols, padded);
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store_nat(row, acc0[r] + load_nat(padded));
    store_nat(row + kNW, acc1[r] + load_nat(padded + kNW));
    store_row(out + r * ldo, row, cols, accumulate);
  }
#endif
}

using TileBf16Fn = void (*)(const void*, int64_t, const uint32_t*, int64_t, int64_t, const float*, float*, int64_t,
                            int64_t, bool);

template <int... R>
constexpr auto make_bf16_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileBf16Fn, sizeof...(R)>{&tile_bf16<R + 1>...};
}
constexpr auto kBf16Tiles = make_bf16_tiles(std::make_integer_sequence<int, kMaxTileRows>{});


// What a bf16 panel matmul reads and writes; the caller has checked every shape.
struct PanelMatmulBf16 {
  const float* x;          // [rows, k_len], row stride ldx, last dim contiguous
  int64_t ldx;
  int64_t rows;
  const uint32_t* packed;  // [panels, pairs, kPanel] bf16 pairs
  int64_t panels;
  int64_t pairs;
  int64_t k_len;
  const float* bias;       // [n], or nullptr
  float* out;              // [rows, n], row stride ldo
  int64_t ldo;
  int64_t n;
};

// Checks one bf16 linear's tensors and returns its problem: out [rows, n] float32 contiguous
// (written), x [rows, k] float32 with a contiguous last dim, packed [panels, ceil(k / 2),
// kPanel, 2] bfloat16 contiguous, bias [n] float32 contiguous or empty. `what` names the op.
inline PanelMatmulBf16 panel_problem_bf16(const char* what, const torch::stable::Tensor& out,
                                          const torch::stable::Tensor& x, const torch::stable::Tensor& packed,
                                          const torch::stable::Tensor& bias) {
  using torch::headeronly::ScalarType;
  for (const torch::stable::Tensor* t : {&out, &x, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float, what,
                    ": out, x and bias must be float32 CPU tensors");
  }
  STD_TORCH_CHECK(packed.is_cpu() && packed.scalar_type() == ScalarType::BFloat16 && packed.dim() == 4 &&
                      packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous(),
                  what, ": packed must be a contiguous bfloat16 [panels, in_features / 2, ", kPanel, ", 2] weight");
  const int64_t panels = packed.size(0), pairs = packed.size(1);
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.size(1) + 1) / 2 == pairs, what,
                  ": x must be [rows, in_features] with in_features / 2 rounded up = ", pairs,
                  " and a contiguous last dim");
  const int64_t rows = x.size(0);
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  return PanelMatmulBf16{x.const_data_ptr<float>(),
                         x.stride(0),
                         rows,
                         reinterpret_cast<const uint32_t*>(packed.const_data_ptr()),
                         panels,
                         pairs,
                         x.size(1),
                         bias.numel() ? bias.const_data_ptr<float>() : nullptr,
                         out.mutable_data_ptr<float>(),
                         n,
                         n};
}

// out = x @ weight.T + bias, or out += it with `accumulate`, on torch's intra-op threads over
// (panel, row chunk) items, as panel_matmul.
inline void panel_matmul_bf16(const PanelMatmulBf16& m, bool accumulate) {
  if (m.rows == 0 || m.n == 0) return;
  const int64_t rows = m.rows, pairs = m.pairs, k_len = m.k_len, n = m.n;
#ifdef PAGEDSERVE_DPBF16
  // x as bf16 pairs, once per call (rows x K roundings against rows x K x N multiply-adds):
  // a row of pairs is the row's bf16 values in order (input 2j in the low half), so each row
  // is narrowed on whole vectors, an odd K padded with a zero; a prefill's rows split over
  // the threads (128 rows a task: a decode's few rows are not worth waking them for).
  std::vector<uint32_t> xpairs(rows * pairs);
  torch::stable::parallel_for(0, rows, 128, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(xpairs.data() + r * pairs);
      narrow_bf16(m.x + r * m.ldx, dst, k_len);
      if (k_len % 2) dst[k_len] = 0;
    }
  });
  const void* xs = xpairs.data();
  const int64_t ldx = pairs;
  const int64_t row_bytes = sizeof(uint32_t);
#else
  const void* xs = m.x;
  const int64_t ldx = m.ldx;
  const int64_t row_bytes = sizeof(float);
#endif
  for_each_panel_item(rows, m.panels, n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    const uint32_t* panel = m.packed + p * pairs * kPanel;
    for_each_row_tile(nrows, [&](int64_t done, int64_t mt) {
      const char* xrow = static_cast<const char*>(xs) + (row0 + done) * ldx * row_bytes;
      kBf16Tiles[mt - 1](xrow, ldx, panel, pairs, k_len, m.bias ? m.bias + col0 : nullptr,
                         m.out + (row0 + done) * m.ldo + col0, m.ldo, cols, accumulate);
    });
  });
}

// Whether this build's bf16 matmul computes with AVX-512 BF16 dot products (x rounded to
// bf16), else with fp32 FMAs on widened weights.
constexpr bool kBf16DotProducts =
#ifdef PAGEDSERVE_DPBF16
    true;
#else
    false;
#endif

}  // namespace
