// CPU linear layer over a bf16 weight packed once into column panels; x, bias, out float32.
//
// Op: pagedserve_cpu::panel_linear_bf16(out, x, packed, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, ceil(K / 2), W, 2] bfloat16, contiguous, W = panel_width(): panel p holds
//           output columns W p .. W p + W - 1, and each (k pair, column) holds the column's
//           weights at inputs 2j, 2j + 1 (kernels/linear.py pack_panels_bf16; columns past N
//           and the input past an odd K are zero)
//   bias:   [N] float32, or an empty tensor for none
//   out:    [M, N] float32, contiguous (written)
//
// Why: decode streams every weight once per step; bf16 weights are half the bytes of fp32.
// Where the CPU has AVX-512 BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+), x is rounded to
// bf16 (nearest even) and each instruction (vdpbf16ps) does two multiply-adds per lane, so
// the compute is twice fp32's as well; accumulation is fp32. Elsewhere the weights are
// widened in registers (a shift: bf16 is fp32's top half) and multiplied with the fp32 x by
// FMAs, so only the bytes are saved and x is not rounded.
//
// Results: one output element is one in-order chain over the k pairs, plus the bias, by one
// thread: a row's result does not depend on the other rows, its position or the thread count.
// They differ from the fp32 layer by the bf16 rounding of the weight (and of x with
// AVX-512 BF16): ~2^-9 relative per product.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

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

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

typedef uint32_t vnat_u __attribute__((vector_size(kNW * sizeof(uint32_t))));

// fp32 -> bf16 bits, round to nearest even (NaN kept a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// One tile: R rows of x against one panel of `pairs` k pairs. xs is x as the kernel reads it:
// bf16 pairs packed in 32 bits [R][pairs] (AVX-512 BF16), or fp32 [R][ldx] otherwise.
template <int R>
inline void tile_bf16(const void* xs, int64_t ldx, const uint32_t* panel, int64_t pairs, int64_t k_len,
                      const float* bias, float* out, int64_t ldo, int64_t cols) {
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
    std::copy(row, row + cols, out + r * ldo);
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
    std::copy(row, row + cols, out + r * ldo);
  }
#endif
}

using TileBf16Fn = void (*)(const void*, int64_t, const uint32_t*, int64_t, int64_t, const float*, float*, int64_t,
                            int64_t);

template <int... R>
constexpr auto make_bf16_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileBf16Fn, sizeof...(R)>{&tile_bf16<R + 1>...};
}
constexpr auto kBf16Tiles = make_bf16_tiles(std::make_integer_sequence<int, kMaxTileRows>{});

void panel_linear_bf16(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  const char* what = "panel_linear_bf16";
  for (const Tensor* t : {&out, &x, &bias}) {
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
  const int64_t k_len = x.size(1), rows = x.size(0);
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  if (rows == 0 || n == 0) return;
  const float* xf = x.const_data_ptr<float>();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.const_data_ptr());
  const float* b = bias.numel() ? bias.const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
#ifdef PAGEDSERVE_DPBF16
  // x as bf16 pairs, once per call (rows x K roundings against rows x K x N multiply-adds).
  std::vector<uint32_t> xpairs(rows * pairs, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xf + r * x.stride(0);
    for (int64_t j = 0; j < pairs; ++j) {
      const uint32_t lo = to_bf16(xr[2 * j]);
      const uint32_t hi = 2 * j + 1 < k_len ? to_bf16(xr[2 * j + 1]) : 0u;
      xpairs[r * pairs + j] = lo | (hi << 16);
    }
  }
  const void* xs = xpairs.data();
  const int64_t ldx = pairs;
  const int64_t row_bytes = sizeof(uint32_t);
#else
  const void* xs = xf;
  const int64_t ldx = x.stride(0);
  const int64_t row_bytes = sizeof(float);
#endif
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  torch::stable::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, c = item % chunks;
      const int64_t row0 = c * chunk_rows, nrows = std::min(chunk_rows, rows - row0);
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      const uint32_t* panel = w + p * pairs * kPanel;
      // The first tile full-height (it reads the panel from memory), the rest balanced.
      const int64_t tiles = (nrows + kMaxTileRows - 1) / kMaxTileRows;
      int64_t done = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t left = tiles - t;
        const int64_t m = t == 0 ? std::min<int64_t>(kMaxTileRows, nrows) : (nrows - done + left - 1) / left;
        const char* xrow = static_cast<const char*>(xs) + (row0 + done) * ldx * row_bytes;
        kBf16Tiles[m - 1](xrow, ldx, panel, pairs, k_len, b ? b + col0 : nullptr, o + (row0 + done) * n + col0, n,
                          cols);
        done += m;
      }
    }
  });
}

// Whether this build's bf16 linear computes with AVX-512 BF16 dot products (x rounded to
// bf16), else with fp32 FMAs on widened weights.
bool bf16_dot_products() {
#ifdef PAGEDSERVE_DPBF16
  return true;
#else
  return false;
#endif
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("panel_linear_bf16(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
  m.def("bf16_dot_products() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("panel_linear_bf16", TORCH_BOX(&panel_linear_bf16)); }

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CompositeExplicitAutograd, m) {
  m.impl("bf16_dot_products", TORCH_BOX(&bf16_dot_products));
}
