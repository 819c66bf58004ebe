// CPU decode paged attention: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), fp32 arithmetic over an fp32, bf16 or FP8 cache.
//
// Op: pagedserve_cpu::paged_decode_attention(out, query, key_cache, value_cache,
//     block_tables, seq_lens, token_rows, scale, v_scale=1.0) -> ()
//   out, query:   [T, H, D] float32, head_dim contiguous (out is written in place, only at
//                 the rows token_rows names)
//   key_cache, value_cache: [num_blocks, block_size, KVH, D] contiguous, both float32, both
//                 bfloat16 (K and V rounded to bf16), or both float8_e4m3fn, or both
//                 float8_e5m2 (kernels/src/pagedserve/kernels/fp8.py: the cache holds fp8(K / k_scale), fp8(V / v_scale))
//   block_tables: [S, max_blocks] int32, contiguous; seq_lens: [S] int32; token_rows: [S] int64
//   scale:        the softmax scale, times k_scale for an FP8 cache (the Triton kernel's
//                 qk_scale, without its log2(e)); v_scale multiplies the output (1.0 unless FP8)
//
// bf16 and FP8 values are widened exactly to fp32. bf16 (a shift) is widened in registers
// as the sweeps load each vector, so no widened copy is ever stored; FP8 (F16C conversions
// where the CPU has them, else a 256-entry table per format; see widen) is widened one block
// of one kv head at a time into per-thread scratch (bs x D floats, L1-resident) that the
// fp32 sweeps then read. Why bf16: decode attention streams the whole context's K and V
// every step and is bound by memory bandwidth (~40 % of a 64-sequence step on the default
// model with an fp32 cache); half the bytes, the same arithmetic on the widened values.
// The scales are folded in as the Triton kernel does: k_scale into the query scale,
// v_scale into 1 / denominator.
//
// Work item = (sequence, kv head), or a whole sequence (all its kv heads, each block's rows
// swept as one span) when there are enough sequences. The G = H / KVH query heads sharing
// a kv head are swept together (as many as the register file holds a tile for: all 3 of
// the default model's on AVX-512), so every K and V vector is loaded once for all of them
// and pass 2 runs G x D / 16 independent accumulator chains instead of one head's D / 16.
// Softmax is two-pass in fp32: scores for the whole context (G x seq_len floats per kv
// head, in L1/L2), then exp and the
// P @ V pass. Work items are handed out dynamically from an atomic counter inside one
// parallel_for over torch's own intra-op threads (no second thread pool); items come in
// the order given, so the caller passes sequences longest first. Slots past a sequence's
// length are never read, so whatever stale values (NaN, inf) they hold cannot leak in.
//
// Build time matters (it is JIT-built on first use, and from scratch in CI), and it is
// dominated by parsing torch headers. This file uses only the stable ABI (torch >= 2.10):
// those headers parse in ~1 s where <torch/library.h> + ATen take ~5 s (<torch/extension.h>
// more still), and the library keeps loading across torch versions.
// torch::stable::parallel_for is at::parallel_for inside libtorch, so the kernel runs on
// torch's intra-op threads and the extension needs no -fopenmp (and links no libgomp).
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_checks.h"
#include "vec.h"

#if defined(__F16C__) && defined(__AVX__) && defined(__SSE4_1__)
#include <immintrin.h>
#define PAGEDSERVE_F16C 1
#endif

namespace {

// Blocks are scattered through the cache, so the hardware prefetchers cannot run ahead of
// a sequence; the kernel prefetches the rows it will read about kPrefetchTokens positions
// later itself. Into L2 (locality 1), not L1: prefetcht0 of a whole block stalled on
// fill buffers and gained ~7%, L2 prefetch ~40% (64 x 50-400, 1 thread).
// A block's look-ahead is spread over the sweeps of the current block (Lookahead below), not
// issued as one burst: measured +10-20 % on 30 layers' caches of 4-48 sequences. Likely
// cause: a burst overruns the core's outstanding-miss slots and some prefetches are dropped.
// 48 or 64 tokens ahead measured no better (within the noise, fp32 and bf16 caches).
constexpr int64_t kPrefetchTokens = 32;

// always_inline: GCC's IPA treats a function whose only effect is a prefetch as const and
// deletes calls to it that are not inlined early (it did, through a lambda: no prefetch left).
// rows, row_stride and row_bytes in bytes.
__attribute__((always_inline)) inline void prefetch_rows(const char* rows, int64_t n, int64_t row_stride,
                                                         int64_t row_bytes) {
  for (int64_t o = 0; o < n; ++o) {
    const char* r = rows + o * row_stride;
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(r + byte, 0, 1);
    }
  }
}

// FP8 -> fp32 widening tables, every code exact (both formats are subsets of fp32).
struct Fp8Tables {
  float e4m3fn[256];
  float e5m2[256];
  Fp8Tables() {
    for (int code = 0; code < 256; ++code) {
      const float sign = (code & 0x80) ? -1.0f : 1.0f;
      // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; S.1111.111 is NaN.
      {
        const int e = (code >> 3) & 0xF, m = code & 0x7;
        float v;
        if (e == 0xF && m == 0x7) {
          v = std::numeric_limits<float>::quiet_NaN();
        } else if (e == 0) {
          v = std::ldexp(static_cast<float>(m), -9);  // subnormal: m / 8 * 2^-6
        } else {
          v = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m / 8) * 2^(e - 7)
        }
        e4m3fn[code] = sign * v;
      }
      // e5m2: fp16's top byte: 5 exponent bits (bias 15), 2 mantissa bits, IEEE inf/NaN.
      {
        const int e = (code >> 2) & 0x1F, m = code & 0x3;
        float v;
        if (e == 0x1F) {
          v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
        } else if (e == 0) {
          v = std::ldexp(static_cast<float>(m), -16);  // subnormal: m / 4 * 2^-14
        } else {
          v = std::ldexp(static_cast<float>(4 + m), e - 17);  // (1 + m / 4) * 2^(e - 15)
        }
        e5m2[code] = sign * v;
      }
    }
  }
};

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

enum class Fp8Format { kE4M3, kE5M2 };

// d[0:n] = the fp32 values of FP8 codes s[0:n]. The table alone does ~1 element per cycle
// (a scalar load each), which made the FP8 kernel slower than fp32 (measured ~4x at long
// contexts). With F16C, 8 codes at a time go through fp16, exactly: an e5m2 code is the
// top byte of the fp16 of the same value; an e4m3fn code's low 7 bits shifted left by 7 are
// the fp16 of its magnitude times 2^-8 (subnormals included, which vcvtph2ps converts
// exactly), so the result is scaled by 256 and its NaN code (S.1111.111) patched.
template <Fp8Format kFormat>
inline void widen(const uint8_t* s, float* d, int64_t n, const float* lut) {
  int64_t i = 0;
#ifdef PAGEDSERVE_F16C
  for (; i + 8 <= n; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i));
    if constexpr (kFormat == Fp8Format::kE5M2) {
      const __m128i half = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);  // code << 8
      _mm256_storeu_ps(d + i, _mm256_cvtph_ps(half));
    } else {
      const __m128i w = _mm_cvtepu8_epi16(bytes);
      const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
      __m128i half = _mm_or_si128(_mm_slli_epi16(mag, 7), sign);
      const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
      half = _mm_blendv_epi8(half, _mm_or_si128(sign, _mm_set1_epi16(0x7E00)), nan);
      _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f)));
    }
  }
#endif
  for (; i < n; ++i) d[i] = lut[s[i]];
}

struct Problem : PagedLayout {
  const char* key_cache;  // float, bf16 or FP8 (one byte) elements, see elem_size / lut
  const char* value_cache;
  int64_t elem_size;      // bytes per cache element: 4 (fp32), 2 (bf16) or 1 (FP8)
  const float* lut;       // FP8 code -> fp32 value; nullptr for an fp32 or bf16 cache
  bool widened;           // blocks are widened into scratch (FP8)
  const int64_t* token_rows;
  int64_t max_seq_len;
  float v_scale;  // output multiplier (1 for fp32); scale (PagedLayout) is times k_scale for FP8
};

// Per-thread scratch for up to all KVH kv heads (R = KVH x G query heads): scaled queries
// [R, D], scores [R, Lpad], accumulators [R, D], 1 / softmax denominators [R] and, for an
// FP8 cache, one widened block [block_size, D], where Lpad = max_seq_len + 3 (the scores
// sweep stores whole 4-key tiles) rounded up to kW so the softmax loops run on whole vectors.
struct Scratch {
  int64_t score_stride;
  std::vector<float> q, scores, acc, inv, block;
  explicit Scratch(const Problem& p)
      : score_stride((p.max_seq_len + 3 + kW - 1) / kW * kW),
        q(p.num_kv_heads * p.group * p.head_dim),
        scores(p.num_kv_heads * p.group * score_stride),
        acc(p.num_kv_heads * p.group * p.head_dim),
        inv(p.num_kv_heads * p.group),
        block(p.widened ? p.block_size * p.head_dim : 0) {}
};

// The c-th 16-float vector (elements [c kW, c kW + kW)) of a cache row, as fp32, and its
// scalar element i: read in place from an fp32 row, widened in registers from a bf16 row
// (exact: a shift), so a bf16 block is never stored widened. Rows are addressed in bytes.
struct Fp32Rows {
  static vfloat vec(const char* row, int64_t c) { return load(reinterpret_cast<const float*>(row) + c * kW); }
  static float at(const char* row, int64_t i) { return reinterpret_cast<const float*>(row)[i]; }
};
struct Bf16Rows {
  static vfloat vec(const char* row, int64_t c) {
    vbf16 h;
    std::memcpy(&h, row + c * kW * sizeof(uint16_t), sizeof(h));
    const vuint w = __builtin_convertvector(h, vuint) << 16;
    vfloat f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
  static float at(const char* row, int64_t i) {
    uint16_t h;
    std::memcpy(&h, row + i * sizeof(uint16_t), sizeof(h));
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
};

// Where a 16-float vector spans several registers (AVX2, NEON, SSE2) the sweeps run on the
// build's native vectors (vec.h vnat) instead: GCC keeps an array of 16-float vectors on the
// stack there, and the vfloat sweeps below ran 2.5x slower on AVX2 than on AVX-512. Native
// sweeps do the same per-lane arithmetic in the same order, and fold16 sums a 16-lane
// accumulator in reduce4's association, so every build computes the same scores.
constexpr bool kNativeSweeps = kHalves > 1;

struct Fp32NatRows {
  static vnat vec(const char* row, int64_t i) { return load_nat(reinterpret_cast<const float*>(row) + i * kNW); }
};
struct Bf16NatRows {
  typedef uint16_t vbf16n __attribute__((vector_size(kNW * sizeof(uint16_t))));
  typedef uint32_t vuintn __attribute__((vector_size(kNW * sizeof(uint32_t))));
  static vnat vec(const char* row, int64_t i) {
    vbf16n h;
    std::memcpy(&h, row + i * kNW * sizeof(uint16_t), sizeof(h));
    const vuintn w = __builtin_convertvector(h, vuintn) << 16;
    vnat f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
};

// The sum of a 16-lane vector held as kHalves native vectors v (consumed), associated as
// reduce4 sums each of its rows: lanes [0, 8) + [8, 16), then [0, 4) + [4, 8), then
// (0 + 1) + (2 + 3).
inline float fold16(vnat* v) {
  const vfloat4 r = fold_to_4(v);
  return (r[0] + r[1]) + (r[2] + r[3]);
}

// out[0:4] = the lane sums of p0..p3, reduced together (transpose-and-add): 3x fewer
// shuffles than reducing each alone.
inline void reduce4(vfloat p0, vfloat p1, vfloat p2, vfloat p3, float* out) {
#if defined(__clang__) || __GNUC__ >= 12
  // [p0 half sums (8 lanes) | p1 half sums (8 lanes)], and the same for p2, p3
  const vfloat q01 = __builtin_shufflevector(p0, p1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(p0, p1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vfloat q23 = __builtin_shufflevector(p2, p3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(p2, p3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // 4 lanes per row: [p0 | p1 | p2 | p3]
  const vfloat r = __builtin_shufflevector(q01, q23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(q01, q23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vfloat4 sums = (__builtin_shufflevector(r, r, 0, 4, 8, 12) + __builtin_shufflevector(r, r, 1, 5, 9, 13)) +
                       (__builtin_shufflevector(r, r, 2, 6, 10, 14) + __builtin_shufflevector(r, r, 3, 7, 11, 15));
  std::memcpy(out, &sums, sizeof(sums));
#else
  out[0] = hsum(p0);
  out[1] = hsum(p1);
  out[2] = hsum(p2);
  out[3] = hsum(p3);
#endif
}

// Register budgets, in 16-float vectors (one AVX-512 register, two AVX2 ones, four NEON or
// SSE ones): half the register file holds accumulators, the rest the loaded rows.
constexpr int kVfloatRegisters = kVecRegisters * kNW / kW;
constexpr int kAccumulators = kVfloatRegisters / 2;
// Query heads swept together over one kv head's rows: each K and V vector is loaded (and
// for bf16 widened) once for all of them. The scores tile is 4 keys x GC heads.
constexpr int kValueHeadsTogether = std::max(1, std::min(4, kAccumulators / 4));


// Pass 1 on n <= block_size rows of one kv head: sc[g ss + o] = q_g . k_o for o < n and the
// GC query heads q_g = q + g D. Keys go 4 at a time (a short last tile repeats the last row
// and stores only what is real); per (key, head) the sum runs over the D elements in vector
// order, then reduce4, whatever GC is, so a head's scores do not depend on how many heads
// share its sweep (nor on the ISA). NV = D / kW, or 0 for any D (whole vectors, then scalars).
template <int NV, int GC, class Rows, class Lookahead>
void block_scores(const float* q, int64_t D, const char* k, int64_t k_stride, int64_t n, float* sc, int64_t ss,
                  Lookahead* lookahead) {
  constexpr int QV = NV ? NV : 1;  // query vectors held in registers (NV == 0: from memory)
  const int64_t nv = NV ? NV : D / kW;
  vfloat qv[GC][QV];
  if constexpr (NV > 0) {
    for (int g = 0; g < GC; ++g) {
      for (int c = 0; c < NV; ++c) qv[g][c] = load(q + g * D + c * kW);
    }
  }
  const auto qvec = [&](int g, int64_t c) { return NV ? qv[g][NV ? c : 0] : load(q + g * D + c * kW); };
  for (int64_t o = 0; o < n; o += 4) {
    lookahead->step();
    const char* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + std::min<int64_t>(o + j, n - 1) * k_stride;
    // Sums start from zero, not from the first products: `p0 + k1 * q1` lets the compiler
    // contract either product into the FMA, and it need not choose alike in every build.
    vfloat acc[4][GC] = {};
    for (int64_t c = 0; c < nv; ++c) {
      for (int j = 0; j < 4; ++j) {
        const vfloat kv = Rows::vec(kr[j], c);
        for (int g = 0; g < GC; ++g) acc[j][g] += kv * qvec(g, c);
      }
    }
    // Whole tiles are stored: a short last tile's extra slots are positions a later block
    // overwrites, or past the sequence's length (the scores rows have 3 slots of slack).
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g) {
      float* out = sc + g * ss + o;
      reduce4(acc[0][g], acc[1][g], acc[2][g], acc[3][g], out);
      if constexpr (NV == 0) {
        for (int j = 0; j < 4; ++j) {
          for (int64_t i = nv * kW; i < D; ++i) out[j] += q[g * D + i] * Rows::at(kr[j], i);
        }
      }
    }
  }
}

// Query heads per scores sweep: a 4-key x GC tile of accumulators, the GC heads' query rows
// and 4 key vectors in registers (any D: one head, its query read from memory).
template <int NV>
constexpr int score_heads_together() {
  int gc = 1;
  while (NV > 0 && gc < 4 && 4 * (gc + 1) + (gc + 1) * NV + 4 <= kVfloatRegisters) ++gc;
  return gc;
}

// Vectors of a head's accumulator row done per sweep of the rows: GC x CV accumulators fit
// the budget, and CV divides NV (any D: one at a time).
template <int NV, int GC>
constexpr int columns_together() {
  int cv = 1;
  while (NV % (2 * cv) == 0 && 2 * cv <= NV && GC * 2 * cv <= kAccumulators) cv *= 2;
  return cv;
}

// acc_g[c kW' .. ] += sum_o w_g[o] v_o over the ncols vectors (of V: a vfloat, or a native
// vector of the build, kW' floats) of the GC heads' accumulator rows, CN columns per sweep of
// the rows: GC x CN accumulators in registers, each getting one multiply-add per key.
template <class V, int CN, int GC, class VRows, class Lookahead>
void value_columns(float* acc, int64_t D, const float* w, int64_t ss, const char* v, int64_t v_stride, int64_t n,
                   int64_t ncols, Lookahead* lookahead) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  for (int64_t c0 = 0; c0 < ncols; c0 += CN) {
    V a[GC][CN];
    for (int g = 0; g < GC; ++g) {
      for (int c = 0; c < CN; ++c) a[g][c] = load_as<V>(acc + g * D + (c0 + c) * kWidth);
    }
    for (int64_t o = 0; o < n; ++o) {
      lookahead->step();
      const char* row = v + o * v_stride;
      for (int c = 0; c < CN; ++c) {
        const V vv = VRows::vec(row, c0 + c);
        for (int g = 0; g < GC; ++g) a[g][c] += (w[g * ss + o] - V{}) * vv;
      }
    }
    for (int g = 0; g < GC; ++g) {
      for (int c = 0; c < CN; ++c) store_as<V>(acc + g * D + (c0 + c) * kWidth, a[g][c]);
    }
  }
}

// Pass 2 on n rows of one kv head: acc_g[0:D] += sum_o w_g[o] v_o for the GC query heads
// (w_g = w + g ss, acc_g = acc + g D), keys in order. Each accumulator vector gets one
// multiply-add per key, so GC x CV independent chains hide the FMA latency that one head's
// row alone (NV chains) could not.
template <int NV, int GC, class Rows, class Lookahead>
void block_values(float* acc, int64_t D, const float* w, int64_t ss, const char* v, int64_t v_stride, int64_t n,
                  Lookahead* lookahead) {
  constexpr int CV = columns_together<NV, GC>();
  const int64_t nv = NV ? NV : D / kW;
  value_columns<vfloat, CV, GC, Rows>(acc, D, w, ss, v, v_stride, n, nv, lookahead);
  if constexpr (NV == 0) {
    for (int64_t o = 0; o < n; ++o) {
      const char* row = v + o * v_stride;
      for (int g = 0; g < GC; ++g) {
        for (int64_t i = nv * kW; i < D; ++i) acc[g * D + i] += w[g * ss + o] * Rows::at(row, i);
      }
    }
  }
}

// block_scores in native vectors (kNativeSweeps, NV > 0): 4 keys x GC heads x kHalves
// accumulators, the query read from L1 (its D floats would not fit beside them).
template <int NV, int GC, class NatRows, class Lookahead>
void block_scores_native(const float* q, int64_t D, const char* k, int64_t k_stride, int64_t n, float* sc,
                         int64_t ss, Lookahead* lookahead) {
  for (int64_t o = 0; o < n; o += 4) {
    lookahead->step();
    const char* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + std::min<int64_t>(o + j, n - 1) * k_stride;
    // Sums start from zero (not from the first product, which would let the compiler
    // contract either product of the first add into the FMA, differently per instantiation).
    vnat acc[4][GC][kHalves] = {};
    for (int c = 0; c < NV; ++c) {
      for (int h = 0; h < kHalves; ++h) {
        const int64_t i = c * kHalves + h;
        for (int j = 0; j < 4; ++j) {
          const vnat kv = NatRows::vec(kr[j], i);
          for (int g = 0; g < GC; ++g) acc[j][g][h] += kv * load_nat(q + g * D + i * kNW);
        }
      }
    }
    for (int g = 0; g < GC; ++g) {
      for (int j = 0; j < 4; ++j) sc[g * ss + o + j] = fold16(acc[j][g]);
    }
  }
}

// Native columns of the head's accumulator rows per block_values_native sweep: GC x CN
// accumulators, CN value vectors and GC weights in registers.
template <int NV, int GC>
constexpr int native_columns_together() {
  int cn = 1;
  while ((NV * kHalves) % (2 * cn) == 0 && GC * 2 * cn + 2 * cn + GC <= kVecRegisters - 2) cn *= 2;
  return cn;
}

template <int NV, int GC, class NatRows, class Lookahead>
void block_values_native(float* acc, int64_t D, const float* w, int64_t ss, const char* v, int64_t v_stride,
                         int64_t n, Lookahead* lookahead) {
  constexpr int CN = native_columns_together<NV, GC>();
  value_columns<vnat, CN, GC, NatRows>(acc, D, w, ss, v, v_stride, n, NV * kHalves, lookahead);
}

// Query heads per sweep (for_each_head_chunk's kMax) and pass 2's lookahead steps per key
// and chunk of heads, for the sweeps a build and head size use.
template <int NV>
constexpr bool native_sweeps() {
  return kNativeSweeps && NV > 0;
}
template <int NV>
constexpr int score_heads() {
  return native_sweeps<NV>() ? 1 : score_heads_together<NV>();
}
template <int NV>
constexpr int value_heads() {
  return native_sweeps<NV>() ? 3 : kValueHeadsTogether;
}
template <int NV>
int64_t value_column_chunks(int64_t D) {
  if constexpr (native_sweeps<NV>()) {
    return NV * kHalves / native_columns_together<NV, value_heads<NV>()>();
  } else {
    return (NV ? NV : D / kW) / columns_together<NV, kValueHeadsTogether>();
  }
}

// The two passes' sweeps of one kv head's rows, per chunk of GC query heads.
template <int NV, class Rows, class NatRows>
struct ScoresSweep {
  template <int GC, class Lookahead>
  static void run(int64_t g0, const float* q, int64_t D, const char* k, int64_t ks, int64_t n, float* sc,
                  int64_t ss, Lookahead* lookahead) {
    if constexpr (native_sweeps<NV>()) {
      block_scores_native<NV, GC, NatRows>(q + g0 * D, D, k, ks, n, sc + g0 * ss, ss, lookahead);
    } else {
      block_scores<NV, GC, Rows>(q + g0 * D, D, k, ks, n, sc + g0 * ss, ss, lookahead);
    }
  }
};
template <int NV, class Rows, class NatRows>
struct ValuesSweep {
  template <int GC, class Lookahead>
  static void run(int64_t g0, float* acc, int64_t D, const float* w, int64_t ss, const char* v, int64_t vs,
                  int64_t n, Lookahead* lookahead) {
    if constexpr (native_sweeps<NV>()) {
      block_values_native<NV, GC, NatRows>(acc + g0 * D, D, w + g0 * ss, ss, v, vs, n, lookahead);
    } else {
      block_values<NV, GC, Rows>(acc + g0 * D, D, w + g0 * ss, ss, v, vs, n, lookahead);
    }
  }
};

// Sweep::run<GC>(g0, args...) over chunks [g0, g0 + GC) tiling query heads [0, G), at most
// kMax at a time (a template argument, so the tile lives in registers).
template <class Sweep, int kMax, class... Args>
void for_each_head_chunk(int64_t G, Args... args) {
  int64_t g0 = 0;
  for (; g0 + kMax <= G; g0 += kMax) Sweep::template run<kMax>(g0, args...);
  switch (G - g0) {
    case 0:
      break;
    case 1:
      Sweep::template run<1>(g0, args...);
      break;
    case 2:
      Sweep::template run<2>(g0, args...);
      break;
    default:
      Sweep::template run<3>(g0, args...);
  }
}

// Cache element types, the kernel's template argument.
constexpr int kCacheFp32 = 0, kCacheE4M3 = 1, kCacheE5M2 = 2, kCacheBf16 = 3;

// One sequence's blocks, as seen from one kv head's slice of each row. Strides in elements
// of the cache; elem_size bytes each.
struct Blocks {
  const int32_t* table;
  int64_t num_blocks, seq_len, block_size, block_stride, row_stride, head_dim;
  int64_t span;  // elements of a row the item reads (and prefetches): its kv heads' slices
  int64_t elem_size;
  const float* lut;  // FP8 cache: the widening table; nullptr: fp32, bf16
  float* widened;    // FP8 cache: [block_size, D] scratch

  const char* raw_rows(const char* head, int64_t b) const {
    return head + static_cast<int64_t>(table[b]) * block_stride * elem_size;
  }
  // The first n rows of block b as the sweeps read them, and the stride between them in
  // bytes: the cache itself for fp32 and bf16 (widened in registers, Bf16Rows), FP8 widened
  // into the fp32 scratch (stride D).
  template <int kCache>
  const char* rows(const char* head, int64_t b, int64_t n, int64_t& stride) const {
    const char* raw = raw_rows(head, b);
    if constexpr (kCache == kCacheFp32 || kCache == kCacheBf16) {
      stride = row_stride * elem_size;
      return raw;
    } else {
      constexpr Fp8Format format = kCache == kCacheE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(raw);
      for (int64_t o = 0; o < n; ++o) widen<format>(src + o * row_stride, widened + o * head_dim, head_dim, lut);
      stride = head_dim * static_cast<int64_t>(sizeof(float));
      return reinterpret_cast<const char*>(widened);
    }
  }
  // Prefetch rows [n * part / parts, n * (part + 1) / parts) of block b's n rows (the whole
  // block by default); nothing past the sequence's last block. always_inline for the same
  // reason as prefetch_rows.
  __attribute__((always_inline)) void prefetch(const char* head, int64_t b, int64_t part = 0,
                                               int64_t parts = 1) const {
    if (b < num_blocks) {
      const int64_t n = std::min(block_size, seq_len - b * block_size);
      const int64_t lo = n * part / parts, hi = n * (part + 1) / parts;
      prefetch_rows(raw_rows(head, b) + lo * row_stride * elem_size, hi - lo, row_stride * elem_size,
                    span * elem_size);
    }
  }
};

// One block's look-ahead, spread over the sweeps of the current block: each step() (one per
// key tile in pass 1, one per key in pass 2) prefetches the next of `parts` slices of its
// rows, and finish() whatever is left. One slice per kv head's sweep (bursts 3x larger)
// measured 20-25 % slower on an fp32 cache.
struct Lookahead {
  const Blocks& blocks;
  const char* base;
  int64_t b, parts;
  int64_t next = 0;
  __attribute__((always_inline)) void step() {
    if (next < parts) blocks.prefetch(base, b, next++, parts);
  }
  void finish() {
    while (next < parts) step();
  }
};

// One work item: sequence s, kv heads [h0, h0 + nh), i.e. query heads [h0 G, (h0 + nh) G).
// Each block is swept once for all of the item's kv heads, head after head: a token's kv
// heads sit side by side in its row, so a whole sequence's item reads each block's rows as
// one contiguous span (its prefetch too) rather than one head's slice per sweep. Per head
// and query head the arithmetic and its order are those of a one-head item.
template <int NV, int kCache>
void attend_heads(const Problem& p, int64_t s, int64_t h0, int64_t nh, Scratch& scratch) {
  const int64_t D = p.head_dim;
  const int64_t G = p.group;
  const int64_t R = nh * G;  // query heads of the item
  const int64_t L = p.seq_lens[s];
  const int64_t row = p.token_rows[s];
  const int32_t* table = p.block_tables + s * p.max_blocks;
  const int64_t bs = p.block_size;
  const int64_t num_blocks = (L + bs - 1) / bs;
  const int64_t pf_blocks = (kPrefetchTokens + bs - 1) / bs;
  // Elements between consecutive token rows of one kv head, and between blocks.
  const int64_t row_stride = p.num_kv_heads * D;
  const int64_t block_stride = bs * row_stride;
  const int64_t head_bytes = D * p.elem_size;
  const char* k_base = p.key_cache + h0 * head_bytes;
  const char* v_base = p.value_cache + h0 * head_bytes;
  const Blocks blocks{table, num_blocks, L, bs, block_stride, row_stride, D, nh * D, p.elem_size, p.lut,
                      scratch.block.data()};
  const int64_t ss = scratch.score_stride;
  float* q = scratch.q.data();            // [R, D]
  float* scores = scratch.scores.data();  // [R, ss], positions >= L unused
  float* acc = scratch.acc.data();        // [R, D]

  for (int64_t r = 0; r < R; ++r) {
    const float* src = p.query + row * p.q_stride_t + (h0 * G + r) * p.q_stride_h;
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = src[d] * p.scale;
  }

  // Pass 1: scores = (q * scale) . k for every context position, straight from the blocks.
  // A kv head's block rows are swept once per chunk of its query heads (all G in one on
  // AVX-512) and stay in L1 between chunks. The block after next is prefetched in parts, one
  // per (kv head, chunk); the last K blocks' look-ahead goes to the first V blocks, so pass 2
  // does not start cold.
  using Rows = std::conditional_t<kCache == kCacheBf16, Bf16Rows, Fp32Rows>;
  using NatRows = std::conditional_t<kCache == kCacheBf16, Bf16NatRows, Fp32NatRows>;
  for (int64_t b = 0; b < pf_blocks; ++b) blocks.prefetch(k_base, b);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t ahead = b + pf_blocks;
    const char* pf_base = ahead < num_blocks ? k_base : v_base;
    const int64_t pf_b = ahead < num_blocks ? ahead : ahead - num_blocks;
    const int64_t pos = b * bs;
    const int64_t n = std::min(bs, L - pos);
    constexpr int kScoreHeads = score_heads<NV>();
    Lookahead lookahead{blocks, pf_base, pf_b, nh * ((G + kScoreHeads - 1) / kScoreHeads) * ((n + 3) / 4)};
    for (int64_t hi = 0; hi < nh; ++hi) {
      int64_t rs;
      const char* k_rows = blocks.rows<kCache>(k_base + hi * head_bytes, b, n, rs);
      for_each_head_chunk<ScoresSweep<NV, Rows, NatRows>, kScoreHeads>(G, q + hi * G * D, D, k_rows, rs, n,
                                                             scores + hi * G * ss + pos, ss, &lookahead);
    }
    lookahead.finish();
  }

  // Softmax numerators in place, on whole vectors: the tail past L is padded with -inf
  // (its exp is ~0 and pass 2 never reads it). 1 / denominator scales the output.
  const int64_t l_pad = (L + kW - 1) / kW * kW;
  for (int64_t r = 0; r < R; ++r) {
    float* sc = scores + r * ss;
    for (int64_t i = L; i < l_pad; ++i) sc[i] = -std::numeric_limits<float>::infinity();
    vfloat mv = load(sc);
    for (int64_t i = kW; i < l_pad; i += kW) {
      const vfloat x = load(sc + i);
      mv = greater_of(x, mv);
    }
    const float m = hmax(mv);
    vfloat sum = {};
    for (int64_t i = 0; i < l_pad; i += kW) {
      const vfloat e = exp_nonpositive(load(sc + i) - m);
      store(sc + i, e);
      sum += e;
    }
    // Padding adds at most exp(-87) ~ 1e-38 per slot: nothing at fp32 resolution.
    scratch.inv[r] = p.v_scale / hsum(sum);
  }

  // Pass 2: acc = P @ V, block by block, each head's accumulator row in registers.
  std::fill(acc, acc + R * D, 0.0f);
  // Lookahead steps per key of a block: one per (kv head, chunk of heads, column chunk).
  constexpr int kValueHeads = value_heads<NV>();
  const int64_t value_steps = nh * ((G + kValueHeads - 1) / kValueHeads) * value_column_chunks<NV>(D);
  // Pass 1's last pf_blocks blocks prefetched V blocks [0, pf_blocks), all but the first
  // pf_blocks - num_blocks where the sequence is shorter than that.
  for (int64_t b = 0; b < pf_blocks - num_blocks; ++b) blocks.prefetch(v_base, b);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t pos = b * bs;
    const int64_t n = std::min(bs, L - pos);
    Lookahead lookahead{blocks, v_base, b + pf_blocks, value_steps * n};
    for (int64_t hi = 0; hi < nh; ++hi) {
      int64_t rs;
      const char* v_rows = blocks.rows<kCache>(v_base + hi * head_bytes, b, n, rs);
      for_each_head_chunk<ValuesSweep<NV, Rows, NatRows>, kValueHeads>(G, acc + hi * G * D, D, scores + hi * G * ss + pos,
                                                                      ss, v_rows, rs, n, &lookahead);
    }
    lookahead.finish();
  }

  for (int64_t r = 0; r < R; ++r) {
    float* dst = p.out + row * p.out_stride_t + (h0 * G + r) * p.out_stride_h;
    const float inv = scratch.inv[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

template <int NV, int kCache>
void run(const Problem& p, int64_t num_seqs) {
  // Whole sequences per item when there are enough of them: a sequence's kv heads share
  // cache lines and DRAM pages (rows interleave heads), which then stay on one core.
  const int64_t threads_hint = torch::stable::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 4 * threads_hint ? p.num_kv_heads : 1;
  const int64_t num_items = num_seqs * p.num_kv_heads / heads_per_item;
  std::atomic<int64_t> next{0};
  // One task per intra-op thread; each pulls (sequence, kv head) items until none are left,
  // so ragged lengths balance without a cost model (the caller orders sequences longest
  // first). A nested call (already inside a parallel region) runs every item inline.
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads, num_items));
  torch::stable::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    Scratch scratch(p);
    for (;;) {
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= num_items) break;
      if (heads_per_item == 1) {
        attend_heads<NV, kCache>(p, item / p.num_kv_heads, item % p.num_kv_heads, 1, scratch);
      } else {
        attend_heads<NV, kCache>(p, item, 0, p.num_kv_heads, scratch);
      }
    }
  });
}

template <int kCache>
void dispatch_head_dim(const Problem& p, int64_t num_seqs) {
  switch (p.head_dim) {
    case 64:
      run<64 / kW, kCache>(p, num_seqs);
      break;
    case 128:
      run<128 / kW, kCache>(p, num_seqs);
      break;
    default:
      run<0, kCache>(p, num_seqs);
  }
}

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

void paged_decode_attention(
    Tensor out,
    Tensor query,
    Tensor key_cache,
    Tensor value_cache,
    Tensor block_tables,
    Tensor seq_lens,
    Tensor token_rows,
    double scale,
    double v_scale) {
  check_query_and_caches(out, query, key_cache, value_cache, "paged_decode_attention");
  for (const Tensor* t : {&out, &query}) {
    STD_TORCH_CHECK(t->scalar_type() == ScalarType::Float, "paged_decode_attention supports float32 only");
  }
  const ScalarType cache_type = key_cache.scalar_type();
  STD_TORCH_CHECK(
      cache_type == ScalarType::Float || cache_type == ScalarType::Float8_e4m3fn ||
          cache_type == ScalarType::Float8_e5m2 || cache_type == ScalarType::BFloat16,
      "paged_decode_attention supports a float32, bfloat16, float8_e4m3fn or float8_e5m2 cache");
  STD_TORCH_CHECK(value_cache.scalar_type() == cache_type, "value_cache dtype != key_cache dtype");
  const bool bf16 = cache_type == ScalarType::BFloat16;
  const bool fp8 = cache_type != ScalarType::Float && !bf16;
  STD_TORCH_CHECK(fp8 || v_scale == 1.0, "v_scale must be 1.0 for a float32 or bfloat16 cache");
  STD_TORCH_CHECK(std::isfinite(v_scale) && std::isfinite(scale), "scale and v_scale must be finite");
  const int64_t num_seqs = check_block_tables(block_tables);
  check_int_vector(seq_lens, ScalarType::Int, num_seqs, "seq_lens must be a contiguous int32 [S] CPU tensor");
  check_int_vector(token_rows, ScalarType::Long, num_seqs, "token_rows must be a contiguous int64 [S] CPU tensor");

  Problem p{};
  static_cast<PagedLayout&>(p) = paged_layout(out, query, key_cache, block_tables, seq_lens, scale);
  // Validate the indices up front (a few thousand ints), so the hot loop needs no checks.
  const int64_t num_tokens = query.size(0);
  const int64_t* rows = token_rows.const_data_ptr<int64_t>();
  int64_t max_seq_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    max_seq_len = std::max(max_seq_len, check_sequence(p, s, key_cache.size(0)));
    STD_TORCH_CHECK(rows[s] >= 0 && rows[s] < num_tokens, "token_rows[", s, "] = ", rows[s], " out of range");
  }
  if (num_seqs == 0) {
    return;
  }

  p.key_cache = static_cast<const char*>(key_cache.const_data_ptr());
  p.value_cache = static_cast<const char*>(value_cache.const_data_ptr());
  p.elem_size = fp8 ? 1 : bf16 ? 2 : static_cast<int64_t>(sizeof(float));
  p.widened = fp8;
  p.lut = !fp8                                    ? nullptr
          : cache_type == ScalarType::Float8_e4m3fn ? fp8_tables().e4m3fn
                                                    : fp8_tables().e5m2;
  p.token_rows = rows;
  p.max_seq_len = max_seq_len;
  p.v_scale = static_cast<float>(v_scale);

  if (bf16) {
    dispatch_head_dim<kCacheBf16>(p, num_seqs);
  } else if (!fp8) {
    dispatch_head_dim<kCacheFp32>(p, num_seqs);
  } else if (cache_type == ScalarType::Float8_e4m3fn) {
    dispatch_head_dim<kCacheE4M3>(p, num_seqs);
  } else {
    dispatch_head_dim<kCacheE5M2>(p, num_seqs);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor token_rows, float scale, float v_scale=1.0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
}
