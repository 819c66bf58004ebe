// CPU linear layer over quantized weights kept quantized in memory, in column panels.
//
// Op: pagedserve_cpu::quant_panel_linear(out, x, values, scales, mins, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   values: the weight's quantized values in the fp32 panels' order (kernels/cpu/panel.h),
//           one k step of a panel after the other (kernels/quant.py pack_quant_panels):
//           8-bit: int8 [P, K, W], W = the panel width (32 AVX-512, 16 AVX2, 8 portable);
//           4-bit: uint8 [P, K, W / 2], byte j holding column j (low nibble) and column
//           j + W / 2 (high nibble), values 0 .. 15
//   scales: float32 [P, K / G, W]: each column's scale for groups of G inputs (G = K / that dim)
//   mins:   float32 [P, K / G, W], or an empty tensor for none (symmetric formats)
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

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel.h"

namespace {

using torch::stable::Tensor;

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
void quant_tile(const float* x, int64_t ldx, const uint8_t* values, const float* scales, const float* mins,
                int64_t k_len, int64_t group, const float* bias, float* out, int64_t ldo, int64_t cols,
                bool accumulate) {
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat_nat(0.0f);
    acc1[r] = splat_nat(0.0f);
  }
  for (int64_t g = 0, k0 = 0; k0 < k_len; ++g, k0 += group) {
    const vnat s0 = load_nat(scales + g * kPanel), s1 = load_nat(scales + g * kPanel + kNW);
    vnat m0 = splat_nat(0.0f), m1 = splat_nat(0.0f);
    if constexpr (HasMin) {
      m0 = load_nat(mins + g * kPanel);
      m1 = load_nat(mins + g * kPanel + kNW);
    }
    for (int64_t k = k0; k < k0 + group; ++k) {
      const uint8_t* q = values + k * kStepBytes<Q4>;
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

using QuantTileFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, int64_t,
                             const float*, float*, int64_t, int64_t, bool);

template <bool Q4, bool HasMin, int... R>
constexpr auto make_quant_tiles(std::integer_sequence<int, R...>) {
  return std::array<QuantTileFn, sizeof...(R)>{&quant_tile<R + 1, Q4, HasMin>...};
}
template <bool Q4, bool HasMin>
constexpr auto kQuantTiles = make_quant_tiles<Q4, HasMin>(std::make_integer_sequence<int, kMaxTileRows>{});

template <bool Q4, bool HasMin>
void quant_matmul(const float* x, int64_t ldx, int64_t rows, const uint8_t* values, const float* scales,
                  const float* mins, int64_t panels, int64_t k_len, int64_t group, const float* bias, float* out,
                  int64_t n) {
  const int64_t groups = k_len / group;
  for_each_panel_item(rows, panels, n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    const uint8_t* v = values + p * k_len * kStepBytes<Q4>;
    const float* s = scales + p * groups * kPanel;
    const float* m = HasMin ? mins + p * groups * kPanel : nullptr;
    for_each_row_tile(nrows, [&](int64_t done, int64_t t) {
      kQuantTiles<Q4, HasMin>[t - 1](x + (row0 + done) * ldx, ldx, v, s, m, k_len, group,
                                     bias ? bias + col0 : nullptr, out + (row0 + done) * n + col0, n, cols,
                                     /*accumulate=*/false);
    });
  });
}

void quant_panel_linear(Tensor out, Tensor x, Tensor values, Tensor scales, Tensor mins, Tensor bias) {
  using torch::headeronly::ScalarType;
  const char* what = "quant_panel_linear";
  for (const Tensor* t : {&out, &x, &scales, &mins, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float, what,
                    ": out, x, scales, mins and bias must be float32 CPU tensors");
  }
  const bool q4 = values.scalar_type() == ScalarType::Byte;
  STD_TORCH_CHECK(values.is_cpu() && (q4 || values.scalar_type() == ScalarType::Char), what,
                  ": values must be uint8 (4-bit) or int8 (8-bit) on the CPU");
  const int64_t step_bytes = q4 ? kPanel / 2 : kPanel;
  STD_TORCH_CHECK(values.dim() == 3 && values.size(2) == step_bytes && values.is_contiguous(), what,
                  ": values must be a contiguous [panels, in_features, ", step_bytes, "] tensor");
  const int64_t panels = values.size(0), k_len = values.size(1);
  STD_TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == kPanel &&
                      scales.is_contiguous() && scales.size(1) > 0 && k_len % scales.size(1) == 0,
                  what, ": scales must be a contiguous [", panels, ", groups, ", kPanel,
                  "] tensor whose groups divide in_features ", k_len);
  const int64_t group = k_len / scales.size(1);
  const bool has_min = mins.numel() != 0;
  STD_TORCH_CHECK(!has_min || (mins.dim() == 3 && mins.size(0) == panels && mins.size(1) == scales.size(1) &&
                                 mins.size(2) == kPanel && mins.is_contiguous()), what,
                  ": mins must be empty or shaped and laid out as scales");
  STD_TORCH_CHECK(!q4 || has_min, what, ": 4-bit values (0 .. 15) need mins");
  STD_TORCH_CHECK(x.dim() == 2 && x.size(1) == k_len && x.stride(1) == 1, what, ": x must be [rows, ", k_len,
                  "] with a contiguous last dim");
  const int64_t rows = x.size(0);
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but values hold ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  if (rows == 0 || n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const auto* v = static_cast<const uint8_t*>(values.const_data_ptr());
  const float* s = scales.const_data_ptr<float>();
  const float* m = has_min ? mins.const_data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  if (q4) {
    quant_matmul<true, true>(xp, x.stride(0), rows, v, s, m, panels, k_len, group, b, o, n);
  } else if (has_min) {
    quant_matmul<false, true>(xp, x.stride(0), rows, v, s, m, panels, k_len, group, b, o, n);
  } else {
    quant_matmul<false, false>(xp, x.stride(0), rows, v, s, m, panels, k_len, group, b, o, n);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("quant_panel_linear(Tensor(a!) out, Tensor x, Tensor values, Tensor scales, Tensor mins, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("quant_panel_linear", TORCH_BOX(&quant_panel_linear)); }
