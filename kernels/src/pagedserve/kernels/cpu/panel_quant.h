// The quantized panel matmul: out (=|+=) x @ weight.T + bias over a weight kept quantized in
// memory, one packed buffer per panel (layout: linear_quant.cpp). Shared by linear_quant.cpp
// (the quant_panel_linear op) and decoder_block.cpp (a decoder layer's matmuls in one op).
// Internal to the extension, like panel.h; the including source defines TORCH_TARGET_VERSION
// and includes torch's stable headers first.
//
// Two ways to multiply, the caller's choice (QuantMatmul::int8_activations):
// - float: each weight de-quantized in registers as the k loop reaches it, times x in fp32:
//   bit-identical to the fp32 panels on the de-quantized weight.
// - integer dot products (as llama.cpp does with its Q8 activations): each row of x rounded
//   to int8 per block of up to 32 inputs (scale = the block's max |x| / 127), then 4 products
//   summed exactly in int32 per instruction (AVX-512 VNNI vpdpbusd, AVX-VNNI, else
//   vpmaddubsw + vpmaddwd; a generic form elsewhere), scaled in fp32 once per block. It reads
//   the same packed weight; its error is the activation rounding's alone (each x off by at
//   most half its block's step), and 4-8x fewer instructions per weight than de-quantizing
//   in registers, which is what bounds a decode step once the weights are 4 bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel.h"

namespace {

typedef int32_t vi32nat __attribute__((vector_size(kNW * sizeof(int32_t))));
typedef uint32_t vu32nat __attribute__((vector_size(kNW * sizeof(uint32_t))));
typedef int32_t vi32nat_unaligned __attribute__((vector_size(kNW * sizeof(int32_t)), aligned(1), may_alias));

PAGEDSERVE_VEC_INLINE vi32nat load_i32nat(const uint8_t* p) { return *reinterpret_cast<const vi32nat_unaligned*>(p); }
template <std::size_t... I>
PAGEDSERVE_VEC_INLINE vi32nat splat_i32nat_lanes(int32_t x, std::index_sequence<I...>) {
  return vi32nat{((void)I, x)...};
}
PAGEDSERVE_VEC_INLINE vi32nat splat_i32nat(int32_t x) { return splat_i32nat_lanes(x, std::make_index_sequence<kNW>{}); }
PAGEDSERVE_VEC_INLINE vnat to_floats(vi32nat v) { return __builtin_convertvector(v, vnat); }

// IEEE half to float, exactly (subnormals, infinities and NaN included), for builds without
// F16C's conversion instruction.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    magnitude = mantissa ? std::nanf("") : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// kNW scales (or mins) at p: float16 (half) or float32. Once per group, off the k loop.
PAGEDSERVE_VEC_INLINE vnat load_scales(const uint8_t* p, bool half) {
  if (!half) {
    vnat v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[kNW];
  for (int i = 0; i < kNW; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof(h));
    f[i] = half_to_float(h);
  }
#endif
  vnat v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

// Bytes of quantized values ahead of the k loop to prefetch into L2 (about the distance of the
// fp32 panel's kPrefetchSteps in time: a few hundred k steps).
constexpr int64_t kPrefetchBytes = 1024;

template <bool Q4>
constexpr int64_t kStepBytes = Q4 ? kPanel / 2 : kPanel;  // bytes per k step of a panel
// The k steps of one chunk: a 32-bit lane holds one column's values for 4 consecutive k, the
// operand shape of the integer dot-product instructions.
constexpr int64_t kChunkSteps = 4;

// One chunk's weights at k step i (0 .. 3) as floats, before their scale: columns [0, kNW)
// into w0, [kNW, 2 kNW) into w1. 4-bit: one vector of lanes, byte i of lane c holds column c
// (low nibble) and column c + kNW (high nibble); 8-bit: two vectors of lanes, byte i of lane c
// holds column c (then c + kNW), signed.
template <bool Q4>
PAGEDSERVE_VEC_INLINE void chunk_step_values(vi32nat a, vi32nat b, int i, vnat& w0, vnat& w1) {
  if constexpr (Q4) {
    const vu32nat u = reinterpret_cast<vu32nat>(a);
    w0 = to_floats(reinterpret_cast<vi32nat>((u >> (8 * i)) & 15u));
    w1 = to_floats(reinterpret_cast<vi32nat>((u >> (8 * i + 4)) & 15u));
  } else {
    w0 = to_floats((a << (24 - 8 * i)) >> 24);  // arithmetic shift: the byte's sign
    w1 = to_floats((b << (24 - 8 * i)) >> 24);
  }
}

// Bytes of one group's scales (and mins): kPanel of them each, 2 or 4 bytes.
template <bool HasMin>
constexpr int64_t scale_bytes(bool half) {
  return kPanel * (half ? 2 : 4) * (HasMin ? 2 : 1);
}

template <int R, bool Q4, bool HasMin>
void quant_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t k_len, int64_t group, bool half,
                const float* bias, float* out, int64_t ldo, int64_t cols, bool accumulate) {
  // One group after the other: its values, then its scales (and mins), kPanel each.
  const int64_t group_stride = group * kStepBytes<Q4> + scale_bytes<HasMin>(half);
  const int64_t scale_size = half ? 2 : 4;
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat_nat(0.0f);
    acc1[r] = splat_nat(0.0f);
  }
  for (int64_t k0 = 0; k0 < k_len; k0 += group) {
    const uint8_t* values = panel + (k0 / group) * group_stride;
    const uint8_t* scales = values + group * kStepBytes<Q4>;
    const vnat s0 = load_scales(scales, half), s1 = load_scales(scales + kNW * scale_size, half);
    vnat m0 = splat_nat(0.0f), m1 = splat_nat(0.0f);
    if constexpr (HasMin) {
      m0 = load_scales(scales + kPanel * scale_size, half);
      m1 = load_scales(scales + (kPanel + kNW) * scale_size, half);
    }
    for (int64_t k = k0; k < k0 + group; k += kChunkSteps) {
      const uint8_t* q = values + (k - k0) * kStepBytes<Q4>;
      __builtin_prefetch(q + kPrefetchBytes, 0, 1);
      const vi32nat a = load_i32nat(q);
      const vi32nat b = Q4 ? a : load_i32nat(q + kNW * sizeof(int32_t));
#pragma GCC unroll 4
      for (int i = 0; i < kChunkSteps; ++i) {
        vnat w0, w1;
        chunk_step_values<Q4>(a, b, i, w0, w1);
        if constexpr (HasMin) {
          w0 = w0 * s0 + m0;  // one FMA: value * scale is exact here (see atop), so one rounding
          w1 = w1 * s1 + m1;
        } else {
          w0 = w0 * s0;
          w1 = w1 * s1;
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const vnat xs = splat_nat(x[r * ldx + k + i]);
          acc0[r] = acc0[r] + xs * w0;
          acc1[r] = acc1[r] + xs * w1;
        }
      }
    }
  }
  finish_tile<R>(acc0, acc1, bias, out, ldo, cols, accumulate);
}

// ---- Integer dot products over int8 activations ----

// Whether this build's dot product takes unsigned weight bytes (x86: vpdpbusd / vpmaddubsw
// multiply unsigned by signed bytes), so signed 8-bit weights go in as |w| with x's sign
// flipped where w < 0; the generic form multiplies signed by signed.
#if defined(__AVX2__) || defined(__AVX512F__)
constexpr bool kUnsignedDot = true;
#else
constexpr bool kUnsignedDot = false;
#endif

// How this build sums the products, for logs and tests, numbered as
// kernels/src/pagedserve/kernels/cpu_ext.py INT8_DOT_PRODUCTS: 0 generic, 1 avx2 (vpmaddubsw + vpmaddwd), 2 avx_vnni,
// 3 avx512bw (the same on AVX-512 without VNNI), 4 avx512_vnni.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int64_t kIntDotProducts = 4;
#elif defined(__AVX512F__)
constexpr int64_t kIntDotProducts = 3;
#elif defined(__AVXVNNI__)
constexpr int64_t kIntDotProducts = 2;
#elif defined(__AVX2__)
constexpr int64_t kIntDotProducts = 1;
#else
constexpr int64_t kIntDotProducts = 0;
#endif

// acc + per 32-bit lane the 4 products of w's bytes and x's bytes (x signed; w unsigned where
// kUnsignedDot, and then below 129 so that vpmaddubsw's pair sums never saturate, else signed).
PAGEDSERVE_VEC_INLINE vi32nat int_dot(vi32nat acc, vi32nat w, vi32nat x) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return reinterpret_cast<vi32nat>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(w),
                                                       reinterpret_cast<__m512i>(x)));
#elif defined(__AVX512F__)
  const __m512i pairs = _mm512_maddubs_epi16(reinterpret_cast<__m512i>(w), reinterpret_cast<__m512i>(x));
  return acc + reinterpret_cast<vi32nat>(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif defined(__AVXVNNI__)
  return reinterpret_cast<vi32nat>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(w),
                                                           reinterpret_cast<__m256i>(x)));
#elif defined(__AVX2__)
  const __m256i pairs = _mm256_maddubs_epi16(reinterpret_cast<__m256i>(w), reinterpret_cast<__m256i>(x));
  return acc + reinterpret_cast<vi32nat>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) acc += ((w << (24 - 8 * i)) >> 24) * ((x << (24 - 8 * i)) >> 24);
  return acc;
#endif
}

// Signed 8-bit weights for int_dot: |w| (where it takes unsigned bytes), and x with its bytes'
// signs flipped where w's are negative (x * w = |w| * (x * sign w); a zero w zeroes the product
// through |w|).
PAGEDSERVE_VEC_INLINE vi32nat dot_weight_bytes(vi32nat w) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi32nat>(_mm512_abs_epi8(reinterpret_cast<__m512i>(w)));
#elif defined(__AVX2__)
  return reinterpret_cast<vi32nat>(_mm256_abs_epi8(reinterpret_cast<__m256i>(w)));
#else
  return w;
#endif
}
PAGEDSERVE_VEC_INLINE vi32nat dot_x_bytes(vi32nat x, vi32nat w) {
#if defined(__AVX512F__)
  const __m512i xi = reinterpret_cast<__m512i>(x);
  return reinterpret_cast<vi32nat>(
      _mm512_mask_sub_epi8(xi, _mm512_movepi8_mask(reinterpret_cast<__m512i>(w)), _mm512_setzero_si512(), xi));
#elif defined(__AVX2__)
  return reinterpret_cast<vi32nat>(_mm256_sign_epi8(reinterpret_cast<__m256i>(x), reinterpret_cast<__m256i>(w)));
#else
  (void)w;
  return x;
#endif
}

// Inputs per activation scale: the weight's group where it is at most 32, else 32 where that
// divides the group (llama.cpp's Q8 block); 0: no block fits, the matmul stays in floats.
inline int64_t activation_block(int64_t group) {
  if (group % kChunkSteps != 0) return 0;
  if (group <= 32) return group;
  return group % 32 == 0 ? 32 : 0;
}

// x's rows rounded to int8 per block: q = round(x * (1 / scale)) (ties to even), scale = the block's
// max |x| / 127; and per row and weight group the sum of the rounded x (sum of scale * sum q,
// in block order), which a group's min multiplies.
struct Int8Rows {
  std::vector<int8_t> q;      // [rows, k_len]
  std::vector<float> scales;  // [rows, k_len / block]
  std::vector<float> sums;    // [rows, k_len / group]
  int64_t k_len = 0, block = 0, group = 0;

  const int8_t* row_q(int64_t r) const { return q.data() + r * k_len; }
  const float* row_scales(int64_t r) const { return scales.data() + r * (k_len / block); }
  const float* row_sums(int64_t r) const { return sums.data() + r * (k_len / group); }
};

inline void round_row(const float* x, const Int8Rows& a, int8_t* q, float* scales, float* sums) {
  const int64_t per_group = a.group / a.block;
  for (int64_t b = 0; b < a.k_len / a.block; ++b) {
    const float* xb = x + b * a.block;
    int8_t* qb = q + b * a.block;
    float amax = 0.0f;
    for (int64_t j = 0; j < a.block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t total = 0;
    for (int64_t j = 0; j < a.block; ++j) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[j] * inverse)));
      qb[j] = static_cast<int8_t>(v);
      total += qb[j];
    }
    scales[b] = scale;
    float& sum = sums[b / per_group];
    sum = b % per_group == 0 ? 0.0f : sum;
    sum = std::fma(scale, static_cast<float>(total), sum);  // explicit: the same on every build
  }
}

inline void round_rows(const float* x, int64_t ldx, int64_t rows, int64_t k_len, int64_t block, int64_t group,
                       Int8Rows& a) {
  a.k_len = k_len;
  a.block = block;
  a.group = group;
  a.q.resize(static_cast<size_t>(rows * k_len));
  a.scales.resize(static_cast<size_t>(rows * (k_len / block)));
  a.sums.resize(static_cast<size_t>(rows * (k_len / group)));
  auto one = [&](int64_t r) {
    round_row(x + r * ldx, a, a.q.data() + r * k_len, a.scales.data() + r * (k_len / block),
              a.sums.data() + r * (k_len / group));
  };
  if (rows < 64) {
    for (int64_t r = 0; r < rows; ++r) one(r);
  } else {
    torch::stable::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) one(r);
    });
  }
}

// Rows per integer tile: each row holds two int32 and two float accumulators, next to the
// two weight vectors, the broadcast and the constants.
constexpr int kMaxIntRows = kVecRegisters >= 32 ? 6 : 3;

template <int R, bool Q4>
void int_tile(const Int8Rows& a, int64_t row0, const uint8_t* panel, int64_t k_len, int64_t group, bool half,
              const float* bias, float* out, int64_t ldo, int64_t cols, bool accumulate) {
  const int64_t block = a.block;
  const int64_t group_stride = group * kStepBytes<Q4> + scale_bytes<Q4>(half);
  const int64_t scale_size = half ? 2 : 4;
  const vi32nat nibble = splat_i32nat(0x0F0F0F0F);
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat_nat(0.0f);
    acc1[r] = splat_nat(0.0f);
  }
  for (int64_t g = 0; g < k_len / group; ++g) {
    const uint8_t* values = panel + g * group_stride;
    const uint8_t* scales = values + group * kStepBytes<Q4>;
    const vnat s0 = load_scales(scales, half), s1 = load_scales(scales + kNW * scale_size, half);
    for (int64_t b0 = 0; b0 < group; b0 += block) {
      vi32nat i0[R], i1[R];
      for (int r = 0; r < R; ++r) {
        i0[r] = splat_i32nat(0);
        i1[r] = splat_i32nat(0);
      }
      for (int64_t k = b0; k < b0 + block; k += kChunkSteps) {
        const uint8_t* q = values + k * kStepBytes<Q4>;
        __builtin_prefetch(q + kPrefetchBytes, 0, 1);
        vi32nat w0, w1, u0, u1;
        if constexpr (Q4) {
          const vi32nat both = load_i32nat(q);
          u0 = w0 = both & nibble;
          u1 = w1 = reinterpret_cast<vi32nat>(reinterpret_cast<vu32nat>(both) >> 4) & nibble;
        } else {
          w0 = load_i32nat(q);
          w1 = load_i32nat(q + kNW * sizeof(int32_t));
          u0 = dot_weight_bytes(w0);
          u1 = dot_weight_bytes(w1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a.row_q(row0 + r) + g * group + k, sizeof(four));
          const vi32nat xb = splat_i32nat(four);
          if constexpr (Q4) {
            i0[r] = int_dot(i0[r], u0, xb);
            i1[r] = int_dot(i1[r], u1, xb);
          } else {
            i0[r] = int_dot(i0[r], u0, dot_x_bytes(xb, w0));
            i1[r] = int_dot(i1[r], u1, dot_x_bytes(xb, w1));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vnat d = splat_nat(a.row_scales(row0 + r)[(g * group + b0) / block]);
        acc0[r] = acc0[r] + to_floats(i0[r]) * (s0 * d);
        acc1[r] = acc1[r] + to_floats(i1[r]) * (s1 * d);
      }
    }
    if constexpr (Q4) {
      const vnat m0 = load_scales(scales + kPanel * scale_size, half);
      const vnat m1 = load_scales(scales + (kPanel + kNW) * scale_size, half);
      for (int r = 0; r < R; ++r) {
        const vnat sum = splat_nat(a.row_sums(row0 + r)[g]);
        acc0[r] = acc0[r] + m0 * sum;
        acc1[r] = acc1[r] + m1 * sum;
      }
    }
  }
  finish_tile<R>(acc0, acc1, bias, out, ldo, cols, accumulate);
}

using IntTileFn = void (*)(const Int8Rows&, int64_t, const uint8_t*, int64_t, int64_t, bool, const float*, float*,
                           int64_t, int64_t, bool);

template <bool Q4, int... R>
constexpr auto make_int_tiles(std::integer_sequence<int, R...>) {
  return std::array<IntTileFn, sizeof...(R)>{&int_tile<R + 1, Q4>...};
}
template <bool Q4>
constexpr auto kIntTiles = make_int_tiles<Q4>(std::make_integer_sequence<int, kMaxIntRows>{});

using QuantTileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, bool, const float*, float*,
                             int64_t, int64_t, bool);

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
  bool q4;           // 4-bit values with mins; else 8-bit values without
  bool half_scales;  // float16 scales (and mins); else float32
  const float* bias;  // [n], or nullptr
  float* out;         // [rows, n], row stride ldo
  int64_t ldo;
  int64_t n;
  bool int8_activations;  // integer dot products over x rounded to int8 (where a block fits)
};

template <bool Q4, bool HasMin>
void quant_matmul_as(const QuantMatmul& m, bool accumulate) {
  for_each_panel_item(m.rows, m.panels, m.n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    const uint8_t* panel = m.packed + p * m.panel_bytes;
    for_each_row_tile(nrows, [&](int64_t done, int64_t t) {
      kQuantTiles<Q4, HasMin>[t - 1](m.x + (row0 + done) * m.ldx, m.ldx, panel, m.k_len, m.group, m.half_scales,
                                     m.bias ? m.bias + col0 : nullptr, m.out + (row0 + done) * m.ldo + col0, m.ldo,
                                     cols, accumulate);
    });
  });
}

template <bool Q4>
void int_matmul_as(const QuantMatmul& m, const Int8Rows& a, bool accumulate) {
  for_each_panel_item(m.rows, m.panels, m.n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    const uint8_t* panel = m.packed + p * m.panel_bytes;
    for_each_row_tile<kMaxIntRows>(nrows, [&](int64_t done, int64_t t) {
      kIntTiles<Q4>[t - 1](a, row0 + done, panel, m.k_len, m.group, m.half_scales, m.bias ? m.bias + col0 : nullptr,
                           m.out + (row0 + done) * m.ldo + col0, m.ldo, cols, accumulate);
    });
  });
}

// out = x @ weight.T + bias, or out += it with `accumulate`.
inline void quant_matmul(const QuantMatmul& m, bool accumulate) {
  if (m.rows == 0 || m.n == 0) return;
  const int64_t block = activation_block(m.group);
  if (m.int8_activations && block > 0) {
    Int8Rows a;
    round_rows(m.x, m.ldx, m.rows, m.k_len, block, m.group, a);
    if (m.q4) {
      int_matmul_as<true>(m, a, accumulate);
    } else {
      int_matmul_as<false>(m, a, accumulate);
    }
  } else if (m.q4) {
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
// (written), x [rows, k] with a contiguous last dim, packed [panels, groups, group_bytes]
// contiguous uint8 or int8 (layout: linear_quant.cpp), bias [n] or empty, all on the CPU.
// `what` names the op.
inline QuantMatmul quant_problem(const char* what, const torch::stable::Tensor& out, const torch::stable::Tensor& x,
                                 const torch::stable::Tensor& packed, const torch::stable::Tensor& bias,
                                 bool int8_activations) {
  using torch::headeronly::ScalarType;
  for (const torch::stable::Tensor* t : {&out, &x, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float, what,
                    ": out, x and bias must be float32 CPU tensors");
  }
  STD_TORCH_CHECK(packed.is_cpu() && is_quantized(packed) && packed.dim() == 3 && packed.is_contiguous(), what,
                  ": packed must be a contiguous uint8 (4-bit) or int8 (8-bit) [panels, groups, bytes] CPU tensor");
  const bool q4 = packed.scalar_type() == ScalarType::Byte;
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [rows, in_features] with a contiguous last dim");
  const int64_t rows = x.size(0), k_len = x.size(1);
  const int64_t panels = packed.size(0), groups = packed.size(1), group_bytes = packed.size(2);
  const bool whole = groups > 0 && k_len % groups == 0 && (k_len / groups) % kChunkSteps == 0;
  const int64_t group = whole ? k_len / groups : 0;
  const int64_t scales = group_bytes - group * (q4 ? kPanel / 2 : kPanel);  // bytes after the values
  const bool half = q4 ? scales == scale_bytes<true>(true) : scales == scale_bytes<false>(true);
  const bool full = q4 ? scales == scale_bytes<true>(false) : scales == scale_bytes<false>(false);
  STD_TORCH_CHECK(whole && (half || full), what, ": ", groups, " groups of ", group_bytes, " bytes are not ", k_len,
                  " inputs of ", q4 ? 4 : 8, "-bit values for ", kPanel, " columns in groups of a multiple of ",
                  kChunkSteps, " inputs, each with its float16 or float32 scales", q4 ? " and mins" : "");
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  return QuantMatmul{x.const_data_ptr<float>(),
                     x.stride(0),
                     rows,
                     static_cast<const uint8_t*>(packed.const_data_ptr()),
                     groups * group_bytes,
                     panels,
                     k_len,
                     group,
                     q4,
                     half,
                     bias.numel() ? bias.const_data_ptr<float>() : nullptr,
                     out.mutable_data_ptr<float>(),
                     n,
                     n,
                     int8_activations};
}

}  // namespace
