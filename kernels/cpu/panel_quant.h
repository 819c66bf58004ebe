// The quantized panel matmul: out (=|+=) x @ weight.T + bias over a weight kept quantized in
// memory, one packed buffer per panel (layout: linear_quant.cpp). Shared by linear_quant.cpp
// (the quant_panel_linear op) and decoder_block.cpp (a decoder layer's matmuls in one op).
// Internal to the extension, like panel.h; the including source defines TORCH_TARGET_VERSION
// and includes torch's stable headers first.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel.h"

namespace {

typedef uint8_t vu8nat __attribute__((vector_size(kNW)));
typedef int32_t vi32nat __attribute__((vector_size(kNW * sizeof(int32_t))));

// Bytes to floats through int32 (one vpmovzxbd / vpmovsxbd, then vcvtdq2ps): GCC turns a
// direct byte-to-float __builtin_convertvector into one scalar conversion per lane.
template <typename V>
inline vnat to_floats(V bytes) {
  return __builtin_convertvector(__builtin_convertvector(bytes, vi32nat), vnat);
}

// Bytes of quantized values ahead of the k loop to prefetch into L2 (about the distance of the
// fp32 panel's kPrefetchSteps in time: a few hundred k steps).
constexpr int64_t kPrefetchBytes = 1024;

template <bool Q4>
constexpr int64_t kStepBytes = Q4 ? kPanel / 2 : kPanel;  // bytes per k step of a panel

// kNW signed bytes at q as floats. On x86 by intrinsics: GCC assembled the vector-extension
// forms (a signed-byte vector, or two byte vectors loaded side by side) in general registers,
// lane by lane, which ran 3-5x slower than the fp32 panels.
inline vnat signed_bytes_to_floats(const uint8_t* q) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
#else
  vu8nat b;
  std::memcpy(&b, q, sizeof(b));
  const vi32nat zero_extended = __builtin_convertvector(b, vi32nat);
  const vnat f = __builtin_convertvector((zero_extended << 24) >> 24, vnat);  // sign from bit 7
#endif
  vnat v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

// kNW bytes at q: their low nibbles as floats into lo, their high nibbles into hi.
inline void unpack_nibbles(const uint8_t* q, vnat& lo, vnat& hi) {
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
#endif
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
#if defined(__AVX512F__)
  const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), h = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high));
#else
  const __m256 l = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), h = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
#endif
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
#else
  vu8nat b;
  std::memcpy(&b, q, sizeof(b));
  lo = to_floats(b & static_cast<uint8_t>(15));
  hi = to_floats(b >> 4);
#endif
}

// The weights of one k step of the panel: columns [0, kNW) into w0, [kNW, 2 kNW) into w1,
// before their scale.
template <bool Q4>
inline void load_values(const uint8_t* q, vnat& w0, vnat& w1) {
  if constexpr (Q4) {
    unpack_nibbles(q, w0, w1);
  } else {
    w0 = signed_bytes_to_floats(q);
    w1 = signed_bytes_to_floats(q + kNW);
  }
}

template <int R, bool Q4, bool HasMin>
void quant_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t k_len, int64_t group, const float* bias,
                float* out, int64_t ldo, int64_t cols, bool accumulate) {
  // One group after the other: its values, then its scales (and mins), kPanel floats each.
  const int64_t group_stride = group * kStepBytes<Q4> + kPanel * static_cast<int64_t>(sizeof(float)) * (HasMin ? 2 : 1);
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat_nat(0.0f);
    acc1[r] = splat_nat(0.0f);
  }
  for (int64_t k0 = 0; k0 < k_len; k0 += group) {
    const uint8_t* values = panel + (k0 / group) * group_stride;
    const auto* scales = reinterpret_cast<const float*>(values + group * kStepBytes<Q4>);
    const vnat s0 = load_nat(scales), s1 = load_nat(scales + kNW);
    vnat m0 = splat_nat(0.0f), m1 = splat_nat(0.0f);
    if constexpr (HasMin) {
      m0 = load_nat(scales + kPanel);
      m1 = load_nat(scales + kPanel + kNW);
    }
    for (int64_t k = k0; k < k0 + group; ++k) {
      const uint8_t* q = values + (k - k0) * kStepBytes<Q4>;
      __builtin_prefetch(q + kPrefetchBytes, 0, 1);
      vnat w0, w1;
      load_values<Q4>(q, w0, w1);
      if constexpr (HasMin) {
        w0 = w0 * s0 + m0;  // one FMA: value * scale is exact here (see atop), so one rounding
        w1 = w1 * s1 + m1;
      } else {
        w0 = w0 * s0;
        w1 = w1 * s1;
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const vnat a = splat_nat(x[r * ldx + k]);
        acc0[r] = acc0[r] + a * w0;
        acc1[r] = acc1[r] + a * w1;
      }
    }
  }
  finish_tile<R>(acc0, acc1, bias, out, ldo, cols, accumulate);
}

using QuantTileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, int64_t,
                             int64_t, bool);

template <bool Q4, bool HasMin, int... R>
constexpr auto make_quant_tiles(std::integer_sequence<int, R...>) {
  return std::array<QuantTileFn, sizeof...(R)>{&quant_tile<R + 1, Q4, HasMin>...};
}
template <bool Q4, bool HasMin>
constexpr auto kQuantTiles = make_quant_tiles<Q4, HasMin>(std::make_integer_sequence<int, kMaxTileRows>{});

// What a quantized panel matmul reads and writes; the caller has checked every shape.
struct QuantMatmul {
  const float* x;  // [rows, k_len], row stride ldx
  int64_t ldx;
  int64_t rows;
  const uint8_t* packed;  // [panels, panel_bytes]
  int64_t panel_bytes;
  int64_t panels;
  int64_t k_len;
  int64_t group;
  bool q4;  // 4-bit values with mins; else 8-bit values without
  const float* bias;  // [n], or nullptr
  float* out;         // [rows, n], row stride ldo
  int64_t ldo;
  int64_t n;
};

template <bool Q4, bool HasMin>
void quant_matmul_as(const QuantMatmul& m, bool accumulate) {
  for_each_panel_item(m.rows, m.panels, m.n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    const uint8_t* panel = m.packed + p * m.panel_bytes;
    for_each_row_tile(nrows, [&](int64_t done, int64_t t) {
      kQuantTiles<Q4, HasMin>[t - 1](m.x + (row0 + done) * m.ldx, m.ldx, panel, m.k_len, m.group,
                                     m.bias ? m.bias + col0 : nullptr, m.out + (row0 + done) * m.ldo + col0, m.ldo,
                                     cols, accumulate);
    });
  });
}

// out = x @ weight.T + bias, or out += it with `accumulate`.
inline void quant_matmul(const QuantMatmul& m, bool accumulate) {
  if (m.rows == 0 || m.n == 0) return;
  if (m.q4) {
    quant_matmul_as<true, true>(m, accumulate);
  } else {
    quant_matmul_as<false, false>(m, accumulate);
  }
}

// Whether `packed` is a quantized weight (uint8: 4-bit values and mins; int8: 8-bit values).
inline bool is_quantized(const torch::stable::Tensor& packed) {
  using torch::headeronly::ScalarType;
  return packed.scalar_type() == ScalarType::Byte || packed.scalar_type() == ScalarType::Char;
}

// Checks one quantized linear's tensors and returns its problem: out [rows, n] contiguous
// (written), x [rows, k] with a contiguous last dim, packed [panels, panel_bytes] contiguous
// uint8 or int8 (layout: linear_quant.cpp), bias [n] or empty, all on the CPU. `what` names the op.
inline QuantMatmul quant_problem(const char* what, const torch::stable::Tensor& out, const torch::stable::Tensor& x,
                                 const torch::stable::Tensor& packed, const torch::stable::Tensor& bias) {
  using torch::headeronly::ScalarType;
  for (const torch::stable::Tensor* t : {&out, &x, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float, what,
                    ": out, x and bias must be float32 CPU tensors");
  }
  STD_TORCH_CHECK(packed.is_cpu() && is_quantized(packed) && packed.dim() == 2 && packed.is_contiguous(), what,
                  ": packed must be a contiguous uint8 (4-bit) or int8 (8-bit) [panels, bytes] CPU tensor");
  const bool q4 = packed.scalar_type() == ScalarType::Byte;
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [rows, in_features] with a contiguous last dim");
  const int64_t rows = x.size(0), k_len = x.size(1);
  const int64_t panels = packed.size(0), panel_bytes = packed.size(1);
  const int64_t value_bytes = k_len * (q4 ? kPanel / 2 : kPanel);
  const int64_t group_bytes = kPanel * static_cast<int64_t>(sizeof(float)) * (q4 ? 2 : 1);
  const int64_t groups = k_len > 0 && panel_bytes > value_bytes ? (panel_bytes - value_bytes) / group_bytes : 0;
  STD_TORCH_CHECK(groups > 0 && value_bytes + groups * group_bytes == panel_bytes && k_len % groups == 0, what,
                  ": a panel of ", panel_bytes, " bytes is not ", k_len, " inputs of ", q4 ? 4 : 8,
                  "-bit values for ", kPanel, " columns plus whole groups of scales", q4 ? " and mins" : "");
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  return QuantMatmul{x.const_data_ptr<float>(), x.stride(0), rows, static_cast<const uint8_t*>(packed.const_data_ptr()),
                     panel_bytes, panels, k_len, k_len / groups, q4, bias.numel() ? bias.const_data_ptr<float>() : nullptr,
                     out.mutable_data_ptr<float>(), n, n};
}

}  // namespace
