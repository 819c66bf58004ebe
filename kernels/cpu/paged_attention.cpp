// CPU decode paged attention: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), fp32 arithmetic over an fp32, bf16 or FP8 cache.
//
// Op: pagedserve_cpu::paged_decode_attention(out, query, key_cache, value_cache,
//     block_tables, seq_lens, token_rows, scale, v_scale=1.0) -> ()
//   out, query:   [T, H, D] float32, head_dim contiguous (out is written in place, only at
//                 the rows token_rows names)
//   key_cache, value_cache: [num_blocks, block_size, KVH, D] contiguous, both float32, both
//                 bfloat16 (K and V rounded to bf16), or both float8_e4m3fn, or both
//                 float8_e5m2 (kernels/fp8.py: the cache holds fp8(K / k_scale), fp8(V / v_scale))
//   block_tables: [S, max_blocks] int32, contiguous; seq_lens: [S] int32; token_rows: [S] int64
//   scale:        the softmax scale, times k_scale for an FP8 cache (the Triton kernel's
//                 qk_scale, without its log2(e)); v_scale multiplies the output (1.0 unless FP8)
//
// bf16 and FP8 blocks are widened exactly to fp32 (bf16: a shift; FP8: F16C conversions
// where the CPU has them, else a 256-entry table per format; see widen), one block of one kv
// head at a time into per-thread scratch (bs x D floats, L1-resident), shared by the G query
// heads; the fp32 code then runs on the scratch rows. Why bf16: decode attention streams
// the whole context's K and V every step and is bound by memory bandwidth (~40 % of a
// 64-sequence step on the default model with an fp32 cache); half the bytes, same code.
// The scales are folded in as the Triton kernel does: k_scale into the query scale,
// v_scale into 1 / denominator.
//
// Work item = (sequence, kv head), or a whole sequence (all its kv heads, each block's rows
// swept as one span) when there are enough sequences. The G = H / KVH query heads sharing
// a kv head are done together, so every K and V row is loaded once for all of them.
// Softmax is two-pass in fp32: scores for the whole context (G x seq_len floats per kv head,
// in L1/L2), then exp and the
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
// A block's look-ahead is issued in G parts, one before each query head's sweep of the current
// block, not as one burst of 64 lines: measured +10-20 % on 30 layers' caches of 4-48
// sequences (finer parts, or 48 / 64 tokens ahead, were slower). Likely cause: a burst
// overruns the core's outstanding-miss slots and some prefetches are dropped.
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
  bool widened;           // blocks are widened into scratch (bf16, FP8)
  const int64_t* token_rows;
  int64_t max_seq_len;
  float v_scale;  // output multiplier (1 for fp32); scale (PagedLayout) is times k_scale for FP8
};

// Per-thread scratch for up to all KVH kv heads (R = KVH x G query heads): scaled queries
// [R, D], scores [R, Lpad], accumulators [R, D], 1 / softmax denominators [R] and, for a bf16 or FP8 cache, one widened block [block_size, D],
// where Lpad = max_seq_len rounded up to kW so the softmax loops run on whole vectors.
struct Scratch {
  int64_t score_stride;
  std::vector<float> q, scores, acc, inv, block;
  explicit Scratch(const Problem& p)
      : score_stride((p.max_seq_len + kW - 1) / kW * kW),
        q(p.num_kv_heads * p.group * p.head_dim),
        scores(p.num_kv_heads * p.group * score_stride),
        acc(p.num_kv_heads * p.group * p.head_dim),
        inv(p.num_kv_heads * p.group),
        block(p.widened ? p.block_size * p.head_dim : 0) {}
};

// Head-dim specialisations: NV = D / kW vectors per row, so a query or accumulator row
// lives in NV registers. NV == 0 is the generic runtime-D path.
template <int NV>
struct Row {
  static float dot(const float* a, const float* b, int64_t) {
    vfloat acc = load(a) * load(b);
    for (int c = 1; c < NV; ++c) acc += load(a + c * kW) * load(b + c * kW);
    return hsum(acc);
  }
  // out[0:4] = a . b_k for the 4 rows b_k = b + k * stride. The four 16-lane partial sums
  // are reduced together (transpose-and-add), 3x fewer shuffles than reducing each alone.
  static void dot4(const float* a, const float* b, int64_t stride, float* out, int64_t) {
    vfloat p0 = load(a) * load(b);
    vfloat p1 = load(a) * load(b + stride);
    vfloat p2 = load(a) * load(b + 2 * stride);
    vfloat p3 = load(a) * load(b + 3 * stride);
    for (int c = 1; c < NV; ++c) {
      const vfloat ac = load(a + c * kW);
      p0 += ac * load(b + c * kW);
      p1 += ac * load(b + stride + c * kW);
      p2 += ac * load(b + 2 * stride + c * kW);
      p3 += ac * load(b + 3 * stride + c * kW);
    }
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
  // acc[0:D] += sum_o w[o] * v_rows[o * row_stride : + D] for o < n, acc in registers.
  static void axpy_rows(float* acc, const float* w, const float* v_rows, int64_t n, int64_t row_stride,
                        int64_t) {
    vfloat a[NV];
    for (int c = 0; c < NV; ++c) a[c] = load(acc + c * kW);
    for (int64_t o = 0; o < n; ++o) {
      const float* v = v_rows + o * row_stride;
      const vfloat wo = splat(w[o]);
      for (int c = 0; c < NV; ++c) a[c] += wo * load(v + c * kW);
    }
    for (int c = 0; c < NV; ++c) store(acc + c * kW, a[c]);
  }
};

// Any head_dim: whole vectors while they last, then scalars.
template <>
struct Row<0> {
  static float dot(const float* a, const float* b, int64_t d) {
    const int64_t d_vec = d - d % kW;
    vfloat acc = {};
    for (int64_t i = 0; i < d_vec; i += kW) acc += load(a + i) * load(b + i);
    float sum = hsum(acc);
    for (int64_t i = d_vec; i < d; ++i) sum += a[i] * b[i];
    return sum;
  }
  static void dot4(const float* a, const float* b, int64_t stride, float* out, int64_t d) {
    for (int k = 0; k < 4; ++k) out[k] = dot(a, b + k * stride, d);
  }
  static void axpy_rows(float* acc, const float* w, const float* v_rows, int64_t n, int64_t row_stride,
                        int64_t d) {
    const int64_t d_vec = d - d % kW;
    for (int64_t o = 0; o < n; ++o) {
      const float* v = v_rows + o * row_stride;
      const vfloat wo = splat(w[o]);
      for (int64_t i = 0; i < d_vec; i += kW) store(acc + i, load(acc + i) + wo * load(v + i));
      for (int64_t i = d_vec; i < d; ++i) acc[i] += w[o] * v[i];
    }
  }
};

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
  float* widened;    // bf16 / FP8 cache: [block_size, D] scratch

  const char* raw_rows(const char* head, int64_t b) const {
    return head + static_cast<int64_t>(table[b]) * block_stride * elem_size;
  }
  // The first n rows of block b as fp32, and the stride between them (elements): the
  // cache itself for fp32, the widened scratch (stride D) for bf16 and FP8.
  template <int kCache>
  const float* rows(const char* head, int64_t b, int64_t n, int64_t& stride) const {
    const char* raw = raw_rows(head, b);
    if constexpr (kCache == kCacheFp32) {
      stride = row_stride;
      return reinterpret_cast<const float*>(raw);
    } else if constexpr (kCache == kCacheBf16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(raw);
      for (int64_t o = 0; o < n; ++o) widen_bf16(src + o * row_stride, widened + o * head_dim, head_dim);
      stride = head_dim;
      return widened;
    } else {
      constexpr Fp8Format format = kCache == kCacheE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(raw);
      for (int64_t o = 0; o < n; ++o) widen<format>(src + o * row_stride, widened + o * head_dim, head_dim, lut);
      stride = head_dim;
      return widened;
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
  // A head's block rows are swept once per query head and stay in L1 between them.
  // The last K blocks' look-ahead goes to the first V blocks, so pass 2 does not start cold.
  for (int64_t b = 0; b < pf_blocks; ++b) blocks.prefetch(k_base, b);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t ahead = b + pf_blocks;
    const char* pf_base = ahead < num_blocks ? k_base : v_base;
    const int64_t pf_b = ahead < num_blocks ? ahead : ahead - num_blocks;
    const int64_t pos = b * bs;
    const int64_t n = std::min(bs, L - pos);
    for (int64_t hi = 0; hi < nh; ++hi) {
      int64_t rs;
      const float* k_rows = blocks.rows<kCache>(k_base + hi * head_bytes, b, n, rs);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hi * G + g;
        blocks.prefetch(pf_base, pf_b, r, R);
        const float* qg = q + r * D;
        float* sc = scores + r * ss + pos;
        int64_t o = 0;
        for (; o + 4 <= n; o += 4) Row<NV>::dot4(qg, k_rows + o * rs, rs, sc + o, D);
        for (; o < n; ++o) sc[o] = Row<NV>::dot(qg, k_rows + o * rs, D);
      }
    }
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
      mv = x > mv ? x : mv;
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
  // Pass 1's last pf_blocks blocks prefetched V blocks [0, pf_blocks), all but the first
  // pf_blocks - num_blocks where the sequence is shorter than that.
  for (int64_t b = 0; b < pf_blocks - num_blocks; ++b) blocks.prefetch(v_base, b);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t pos = b * bs;
    const int64_t n = std::min(bs, L - pos);
    for (int64_t hi = 0; hi < nh; ++hi) {
      int64_t rs;
      const float* v_rows = blocks.rows<kCache>(v_base + hi * head_bytes, b, n, rs);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hi * G + g;
        blocks.prefetch(v_base, b + pf_blocks, r, R);
        Row<NV>::axpy_rows(acc + r * D, scores + r * ss + pos, v_rows, n, rs, D);
      }
    }
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
  p.widened = fp8 || bf16;
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
