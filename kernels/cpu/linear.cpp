// CPU fp32 linear layer over a weight packed once into column panels.
//
// Op: pagedserve_cpu::panel_linear(out, x, packed, bias) -> ()
//   x:      [M, K] float32, last dim contiguous (any row stride)
//   packed: [P, K, 32] float32, contiguous: panel p holds output columns 32p .. 32p+31 of
//           the nn.Linear weight [N, K], transposed so one k step of a panel is 32 adjacent
//           floats (kernels/linear.py pack_panels; columns past N are zero)
//   bias:   [N] float32, or an empty tensor for none
//   out:    [M, N] float32, contiguous (written)
//
// Why: at decode row counts (M = 1 .. 64) a step streams every weight once from DRAM, and
// MKL / oneDNN reach 40-80 % of this machine's sgemm peak there (measured on the default
// model's shapes, 2 threads). Here a panel's 32 columns x all of K (74 KB at K = 576) is read
// from memory once, with software prefetch ahead of the k loop, and then stays in L2 while
// every row block of x runs over it: a 12 x 32 register tile (24 accumulators of 16 floats
// on AVX-512), one broadcast of x and two FMAs per row and k. Measured on the default
// model's decode shapes: 1.2-1.6x oneDNN's packed linear at 8-34 rows.
//
// Results: each output element is one fused multiply-add chain over k = 0 .. K-1 in order,
// plus the bias, computed by one thread. So a row's result does not depend on the other rows
// in the call, on the row's position or on the thread count (batch-invariant), and differs
// from MKL's and oneDNN's blocked sums only by accumulation order (~1e-6 relative).
//
// Parallelism: torch's intra-op threads over (panel, row chunk) items; consecutive items of
// a thread share a panel, so its weights are read from memory once per thread.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int64_t kPanel = 2 * kW;  // output columns per panel: two vectors
// Rows per register tile: 2 accumulators per row must fit the vector registers with the two
// panel vectors and a broadcast. AVX-512 has 32 registers of 16 floats; elsewhere a 16-float
// vector spans 2 (AVX2) or 4 (NEON) registers of 16 / 32.
#if defined(__AVX512F__)
constexpr int kMaxTileRows = 12;
#else
constexpr int kMaxTileRows = 3;
#endif
// Rows per work item when a call has many rows (prefill): bounds the slice of x re-read per
// panel (96 x 1536 floats = 590 KB at most) while giving the threads enough items.
constexpr int64_t kChunkRows = 96;
// Prefetch this many k steps ahead in the panel (each is one 128-byte row of the panel).
constexpr int64_t kPrefetchSteps = 16;

template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, const float* bias, float* out,
                 int64_t ldo, int64_t cols) {
  vfloat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat(0.0f);
    acc1[r] = splat(0.0f);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    const float* b = panel + k * kPanel;
    __builtin_prefetch(b + kPrefetchSteps * kPanel);
    __builtin_prefetch(b + kPrefetchSteps * kPanel + kW);
    const vfloat b0 = load(b);
    const vfloat b1 = load(b + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vfloat a = splat(x[r * ldx + k]);
      acc0[r] = acc0[r] + a * b0;  // contracted to one FMA (-ffp-contract=fast, GCC's default)
      acc1[r] = acc1[r] + a * b1;
    }
  }
  if (bias != nullptr) {
    float padded[kPanel] = {};
    std::copy(bias, bias + cols, padded);
    for (int r = 0; r < R; ++r) {
      acc0[r] += load(padded);
      acc1[r] += load(padded + kW);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    if (cols == kPanel) {
      store(o, acc0[r]);
      store(o + kW, acc1[r]);
    } else {
      float row[kPanel];
      store(row, acc0[r]);
      store(row + kW, acc1[r]);
      std::copy(row, row + cols, o);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxTileRows>{});

// Rows [row0, row0 + rows) of the output against one panel, in balanced tiles of at most
// kMaxTileRows rows (34 rows: 12 + 11 + 11, not 12 + 12 + 10 then a ragged tile of rest).
void rows_by_panel(const float* x, int64_t ldx, const float* panel, int64_t k_len, const float* bias, float* out,
                   int64_t ldo, int64_t cols, int64_t rows) {
  const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  int64_t done = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t left = tiles - t;
    const int64_t n = (rows - done + left - 1) / left;
    kTiles[n - 1](x + done * ldx, ldx, panel, k_len, bias, out + done * ldo, ldo, cols);
    done += n;
  }
}

void panel_linear(Tensor out, Tensor x, Tensor packed, Tensor bias) {
  for (const Tensor* t : {&out, &x, &packed, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float,
                    "panel_linear: out, x, packed and bias must be float32 CPU tensors");
  }
  STD_TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
                  "packed must be a contiguous [panels, in_features, ", kPanel, "] weight");
  const int64_t panels = packed.size(0), k_len = packed.size(1);
  STD_TORCH_CHECK(x.dim() == 2 && x.size(1) == k_len && x.stride(1) == 1,
                  "x must be [rows, ", k_len, "] with a contiguous last dim");
  const int64_t rows = x.size(0);
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), "out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()),
                  "bias must be empty or a contiguous [", n, "]");
  if (rows == 0 || n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = packed.const_data_ptr<float>();
  const float* bp = bias.numel() ? bias.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  torch::stable::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, c = item % chunks;
      const int64_t row0 = c * chunk_rows, nrows = std::min(chunk_rows, rows - row0);
      const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
      rows_by_panel(xp + row0 * ldx, ldx, wp + p * k_len * kPanel, k_len, bp ? bp + col0 : nullptr,
                    op + row0 * n + col0, n, cols, nrows);
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor bias) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("panel_linear", TORCH_BOX(&panel_linear)); }
