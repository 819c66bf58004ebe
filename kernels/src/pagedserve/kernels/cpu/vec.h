// Portable SIMD helpers shared by the C++ CPU kernels (paged_attention.cpp, layer_ops.cpp, linear.cpp).
//
// Header-only and internal to the extension: everything is in an unnamed namespace, so each
// source gets its own inlined copy and the library exports no symbol from here.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

// The TORCH_LIBRARY namespace the sources register their ops under: one per ISA build
// (kernels/src/pagedserve/kernels/cpu_ext.py passes -DPAGEDSERVE_OPS=pagedserve_cpu_<isa>), so one process can load
// several builds side by side.
#ifndef PAGEDSERVE_OPS
#define PAGEDSERVE_OPS pagedserve_cpu
#endif

// Every helper here is forced inline: a 16-float vector passed to or returned from a call
// goes through memory where it spans several registers (the x86-64 ABI without AVX-512),
// and GCC declined to inline exp_clamped into the AVX2 build's SiLU loop.
#define PAGEDSERVE_VEC_INLINE inline __attribute__((always_inline))

namespace {

// Explicit portable SIMD through GCC/Clang vector extensions: 16 floats, which the compiler
// maps onto one AVX-512 register, two AVX2 / NEON-pair registers or four SSE ones, whatever
// -march allows. Plain loops left this to the auto-vectoriser, which kept the accumulators
// on the stack and reduced scalar by scalar (measured ~2x slower).
#if !(defined(__GNUC__) || defined(__clang__))
#error "the C++ CPU kernels need GCC or Clang vector extensions"
#endif
constexpr int kW = 16;
typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kW * sizeof(int32_t))));
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

// Unaligned, aliasing access through a vector type: a memcpy of a 16-float vector where it
// spans several registers went through the stack in 16-byte pieces (GCC, AVX2).
typedef float vfloat_unaligned __attribute__((vector_size(kW * sizeof(float)), aligned(4), may_alias));
PAGEDSERVE_VEC_INLINE vfloat load(const float* p) { return *reinterpret_cast<const vfloat_unaligned*>(p); }
PAGEDSERVE_VEC_INLINE void store(float* p, vfloat v) { *reinterpret_cast<vfloat_unaligned*>(p) = v; }
// All lanes x. Written as an initializer so the compiler emits one broadcast (from memory where
// x is loaded); `vfloat{} + x` compiled to a scalar add of +0.0 (it must turn -0.0 into +0.0)
// and a register broadcast, two extra FP-pipe instructions per x in the matmul's inner loop.
PAGEDSERVE_VEC_INLINE vfloat splat(float x) { return vfloat{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// The build's native vector, what one register holds, for the kernels whose tiles must fit
// the register file (the panel matmul): 16 floats x 32 registers on AVX-512, 8 x 16 on
// AVX/AVX2, 4 x 32 on aarch64 NEON and 4 x 16 on baseline x86-64 (SSE2). The logical
// 16-float vfloat above stays the unit of the attention and row kernels, whose per-element
// arithmetic (and so their results) is then the same on every ISA.
#if defined(__AVX512F__)
constexpr int kNW = 16;
constexpr int kVecRegisters = 32;
#elif defined(__AVX__)
constexpr int kNW = 8;
constexpr int kVecRegisters = 16;
#elif defined(__aarch64__)
constexpr int kNW = 4;
constexpr int kVecRegisters = 32;
#else
constexpr int kNW = 4;
constexpr int kVecRegisters = 16;
#endif
typedef float vnat __attribute__((vector_size(kNW * sizeof(float))));

PAGEDSERVE_VEC_INLINE vnat load_nat(const float* p) {
  vnat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGEDSERVE_VEC_INLINE void store_nat(float* p, vnat v) { std::memcpy(p, &v, sizeof(v)); }
template <std::size_t... I>
PAGEDSERVE_VEC_INLINE vnat splat_nat_lanes(float x, std::index_sequence<I...>) {
  return vnat{((void)I, x)...};
}
// All lanes x, as an initializer (one broadcast, as splat below).
PAGEDSERVE_VEC_INLINE vnat splat_nat(float x) { return splat_nat_lanes(x, std::make_index_sequence<kNW>{}); }

// Lane-wise f(v...) (a select, compare or clamp) on 16-lane vectors, run on native vectors.
// GCC lowers a ?: select or a compare on a vector wider than the hardware's lane by lane (a
// scalar compare and blend per float: the AVX2 build's SiLU ran 3.3x slower than the
// AVX-512 one's); split into native vectors, it stays whole-vector. The same lanes get the
// same operation, so results do not change.
#if defined(__clang__) || __GNUC__ >= 12
template <int P, class V, std::size_t... I>
PAGEDSERVE_VEC_INLINE auto vec_part(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (P * kNW + static_cast<int>(I))...);
}
template <int P, class V>
PAGEDSERVE_VEC_INLINE auto vec_part(V v) {
  return vec_part<P>(v, std::make_index_sequence<kNW>{});
}
template <class V, std::size_t... I>
PAGEDSERVE_VEC_INLINE auto vec_join(V lo, V hi, std::index_sequence<I...>) {
  return __builtin_shufflevector(lo, hi, static_cast<int>(I)...);
}
template <class V>
PAGEDSERVE_VEC_INLINE auto vec_join(V lo, V hi) {
  return vec_join(lo, hi, std::make_index_sequence<2 * sizeof(V) / sizeof(lo[0])>{});
}
template <class F, class... V>
PAGEDSERVE_VEC_INLINE auto lanewise(F f, V... v) {
  if constexpr (kNW == kW) {
    return f(v...);
  } else if constexpr (kNW * 2 == kW) {
    return vec_join(f(vec_part<0>(v)...), f(vec_part<1>(v)...));
  } else {
    static_assert(sizeof...(V) > 0 && kNW * 4 == kW, "native vectors of 4, 8 or 16 floats");
    return vec_join(vec_join(f(vec_part<0>(v)...), f(vec_part<1>(v)...)),
                    vec_join(f(vec_part<2>(v)...), f(vec_part<3>(v)...)));
  }
}
#else
template <class F, class... V>
PAGEDSERVE_VEC_INLINE auto lanewise(F f, V... v) {
  return f(v...);
}
#endif

// x where x >= lo, else lo (a NaN stays NaN), lane-wise; and x where x <= hi, else hi. For a
// native vector a plain select; for a vfloat, on its native parts.
template <class V>
PAGEDSERVE_VEC_INLINE V at_least(V x, V lo) {
  const auto f = [](auto a, auto b) { return a < b ? b : a; };
  if constexpr (sizeof(V) == sizeof(vnat)) {
    return f(x, lo);
  } else {
    return lanewise(f, x, lo);
  }
}
template <class V>
PAGEDSERVE_VEC_INLINE V at_most(V x, V hi) {
  const auto f = [](auto a, auto b) { return a > b ? b : a; };
  if constexpr (sizeof(V) == sizeof(vnat)) {
    return f(x, hi);
  } else {
    return lanewise(f, x, hi);
  }
}
// The lane-wise larger of x and m, m where x is not greater (x > m ? x : m).
PAGEDSERVE_VEC_INLINE vfloat greater_of(vfloat x, vfloat m) {
  return lanewise([](auto a, auto b) { return a > b ? a : b; }, x, m);
}

// Native vectors per 16-float vector (1 on AVX-512, 2 on AVX2, 4 on NEON and SSE2): the row
// ops walk a row 16 floats at a time, as native parts, so a row's split between vector and
// scalar code, and so its results, are those of every other build.
constexpr int kHalves = kW / kNW;

// A 16-lane vector held as its kHalves native parts v (consumed), folded to 4 lanes: lanes
// [0, 8) + [8, 16), then [0, 4) + [4, 8), the first two levels of hsum's (and the decode
// attention's reduce4) tree, so a sum finished from here equals theirs.
PAGEDSERVE_VEC_INLINE vfloat4 fold_to_4(vnat* v) {
  for (int n = kHalves; n > 1; n /= 2) {
    for (int i = 0; i < n / 2; ++i) v[i] += v[i + n / 2];
  }
#if (defined(__clang__) || __GNUC__ >= 12) && defined(__AVX512F__)
  const vfloat8 a = __builtin_shufflevector(v[0], v[0], 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v[0], v[0], 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif (defined(__clang__) || __GNUC__ >= 12) && defined(__AVX__)
  return __builtin_shufflevector(v[0], v[0], 0, 1, 2, 3) + __builtin_shufflevector(v[0], v[0], 4, 5, 6, 7);
#else
  // (the preprocessor, not if constexpr: shuffle indices past a narrower vector's end are
  // errors even in a discarded branch of a non-template function)
  float lanes[kNW];
  std::memcpy(lanes, &v[0], sizeof(lanes));
  for (int n = kNW; n > 4; n /= 2) {
    for (int i = 0; i < n / 2; ++i) lanes[i] += lanes[i + n / 2];
  }
  vfloat4 r;
  std::memcpy(&r, lanes, sizeof(r));
  return r;
#endif
}

// The sum of a 16-lane vector held as its kHalves native parts (consumed), as hsum sums it.
PAGEDSERVE_VEC_INLINE float hsum_parts(vnat* v) {
  const vfloat4 b = fold_to_4(v);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// A V (vfloat or the build's native vector) from / to floats, for code written for both.
template <class V>
PAGEDSERVE_VEC_INLINE V load_as(const float* p) {
  if constexpr (sizeof(V) == sizeof(vnat)) {
    return load_nat(p);
  } else {
    return load(p);
  }
}
template <class V>
PAGEDSERVE_VEC_INLINE void store_as(float* p, V v) {
  if constexpr (sizeof(V) == sizeof(vnat)) {
    store_nat(p, v);
  } else {
    store(p, v);
  }
}

PAGEDSERVE_VEC_INLINE float hsum(vfloat v) {
#if defined(__clang__) || __GNUC__ >= 12
  const vfloat8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float sum = 0.0f;
  for (int l = 0; l < kW; ++l) sum += v[l];
  return sum;
#endif
}

PAGEDSERVE_VEC_INLINE float hmax(vfloat v) {
  float m = v[0];
  for (int l = 1; l < kW; ++l) m = std::max(m, v[l]);
  return m;
}

// exp(x) for x in [-87, 88], branch-free on whole vectors: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes expf coefficients, ~1 ulp), 2^n
// built in the exponent bits. Callers clamp first (the bounds keep 2^n a normal float).
template <class V = vfloat>
PAGEDSERVE_VEC_INLINE V exp_in_range(V x) {
  using VI = decltype(x < x);  // the signed integer vector of V's shape
  // Round x / ln2 to the nearest integer by adding 1.5 * 2^23: the sum's low mantissa bits
  // are then that integer (two's complement), and subtracting the constant gives it as a float.
  const V magic = V{} + 12582912.0f;
  const V shifted = x * 1.44269504088896341f + magic;
  const V n = shifted - magic;
  V r = x - n * 0.693359375f;  // ln2 split in two so n * ln2 is exact enough
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // (vector casts reinterpret the bits in registers; a memcpy went through the stack)
  const VI bits = (VI)shifted;
  const VI magic_bits = VI{} + 0x4b400000;  // bit pattern of 12582912.0f
  const VI scale_bits = (bits - magic_bits + 127) << 23;
  return p * (V)scale_bits;
}

// exp(x) for x <= 0 (a score minus its row max). Inputs below -87 give ~1e-38 instead of a
// denormal or 0, which cannot matter next to the row max's exp(0) = 1.
template <class V = vfloat>
PAGEDSERVE_VEC_INLINE V exp_nonpositive(V x) {
  return exp_in_range(at_least(x, V{} - 87.0f));
}

// exp(x) for any x, clamped to [-87, 88]: ~1e-38 below, 1.65e38 (finite) above. Used where
// the result only enters 1 / (1 + exp(-x)), for which both clamps are exact enough.
template <class V = vfloat>
PAGEDSERVE_VEC_INLINE V exp_clamped(V x) {
  return exp_in_range(at_most(at_least(x, V{} - 87.0f), V{} + 88.0f));
}

// bfloat16 is fp32's top half: widening is exact (a shift), narrowing rounds to nearest even
// (a NaN becomes the canonical NaN 0x7FC0), as torch's fp32 -> bf16 cast (c10::BFloat16) does.
typedef uint16_t vbf16 __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(kW * sizeof(uint32_t))));

// d[0:n] = the fp32 values of the bf16 bits s[0:n], whole vectors while they last.
PAGEDSERVE_VEC_INLINE void widen_bf16(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vbf16 h;
    std::memcpy(&h, s + i, sizeof(h));
    const vuint w = __builtin_convertvector(h, vuint) << 16;
    std::memcpy(d + i, &w, sizeof(w));
  }
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &w, sizeof(w));
  }
}

PAGEDSERVE_VEC_INLINE uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// d[0:n] = bf16(s[0:n]), round to nearest even, whole vectors while they last.
PAGEDSERVE_VEC_INLINE void narrow_bf16(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vuint bits;
    std::memcpy(&bits, s + i, sizeof(bits));
    const vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const vuint r = lanewise([](auto b, auto rnd) { return (b & 0x7FFFFFFFu) > 0x7F800000u ? decltype(rnd){} + 0x7FC0u : rnd; },
                             bits, rounded);
    const vbf16 h = __builtin_convertvector(r, vbf16);
    std::memcpy(d + i, &h, sizeof(h));
  }
  for (; i < n; ++i) d[i] = to_bf16(s[i]);
}

}  // namespace
