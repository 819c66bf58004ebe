// The panel matmul at the heart of the fp32 CPU linear layers: out (=|+=) x @ weight.T + bias
// over a weight packed once into column panels of two native vectors (32 columns on
// AVX-512, 16 on AVX2, 8 on SSE2 / NEON; layout and rationale: linear.cpp).
//
// Shared by linear.cpp (the panel_linear op) and decoder_block.cpp (a decoder layer's matmuls
// chained in one op). Internal to the extension: everything is in an unnamed namespace, so
// each source gets its own inlined copy. The including source defines TORCH_TARGET_VERSION and
// includes torch's stable headers first.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace {

constexpr int64_t kPanel = 2 * kNW;  // output columns per panel: two native vectors
// Rows per register tile: 2 accumulators per row must fit the vector registers with the two
// panel vectors and a broadcast. With 32 registers (AVX-512, NEON): 12 rows, 24 + 2 + 1 (13
// and 14 measured no faster on AVX-512). With 16 (AVX2, SSE2): 6 rows, 12 + 2 + 1, the shape
// of BLIS's Haswell sgemm micro-kernel. (The AVX2 build once used 16-float vectors and 3 rows,
// 12 + 4 + 2 of 16 ymm registers: it spilled and ran 2-8x behind oneDNN.)
constexpr int kMaxTileRows = kVecRegisters >= 32 ? 12 : 6;
// Rows per work item when a call has many rows (prefill): bounds the slice of x re-read per
// panel (96 x 1536 floats = 590 KB at most) while giving the threads enough items.
constexpr int64_t kChunkRows = 96;
// Prefetch this many k steps ahead in the panel (each is one 128-byte row of the panel), into
// L2 (locality 1): 32 steps into L2 was 2-4.5 % faster at 8-24 rows than 16 into L1 (the same
// above), on the default model's layers with their weights read from memory.
constexpr int64_t kPrefetchSteps = 32;

// A register tile's epilogue: adds the bias, then writes (or with `accumulate` adds to) the
// tile's rows of out; `cols` < kPanel for the last panel of an output. Shared by the fp32 and
// the quantized (linear_quant.cpp) panel tiles.
template <int R>
inline void finish_tile(vnat (&acc0)[R], vnat (&acc1)[R], const float* bias, float* out, int64_t ldo, int64_t cols,
                        bool accumulate) {
  if (bias != nullptr) {
    float padded[kPanel] = {};
    std::copy(bias, bias + cols, padded);
    for (int r = 0; r < R; ++r) {
      acc0[r] += load_nat(padded);
      acc1[r] += load_nat(padded + kNW);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    if (cols == kPanel) {
      if (accumulate) {
        acc0[r] = load_nat(o) + acc0[r];
        acc1[r] = load_nat(o + kNW) + acc1[r];
      }
      store_nat(o, acc0[r]);
      store_nat(o + kNW, acc1[r]);
    } else {
      float row[kPanel];
      store_nat(row, acc0[r]);
      store_nat(row + kNW, acc1[r]);
      for (int64_t c = 0; c < cols; ++c) o[c] = accumulate ? o[c] + row[c] : row[c];
    }
  }
}

// One output element's value is acc (the in-order FMA chain over k) + bias; `accumulate`
// adds it to what out holds (out + (acc + bias), the order of `out += linear(x)`).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, const float* bias, float* out,
                 int64_t ldo, int64_t cols, bool accumulate) {
  vnat acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = splat_nat(0.0f);
    acc1[r] = splat_nat(0.0f);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    const float* b = panel + k * kPanel;
    __builtin_prefetch(b + kPrefetchSteps * kPanel, 0, 1);
    if constexpr (kPanel * sizeof(float) > 64) __builtin_prefetch(b + kPrefetchSteps * kPanel + 16, 0, 1);
    const vnat b0 = load_nat(b);
    const vnat b1 = load_nat(b + kNW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vnat a = splat_nat(x[r * ldx + k]);
      acc0[r] = acc0[r] + a * b0;  // contracted to one FMA (-ffp-contract=fast, GCC's default)
      acc1[r] = acc1[r] + a * b1;
    }
  }
  finish_tile<R>(acc0, acc1, bias, out, ldo, cols, accumulate);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, bool);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxTileRows>{});

// Rows [row0, row0 + rows) of the output against one panel: a first tile of kMaxTileRows rows,
// then the rest in balanced tiles (34 rows: 12 + 11 + 11; 16 rows: 12 + 4).
// Why the full first tile: it reads the panel from memory, so it runs at the memory's speed
// whatever its height, and the later tiles find the panel in L2. A taller first tile leaves
// fewer rows for the rest (on the default model's layers: 1.7-8.4 % faster at 13-28 rows in
// one comparison, within 1 % in another; the same above 30).
// tile(first row, tile rows) for each tile, in order; shared by the fp32, bf16 and quantized
// matmuls (the integer one with its own, lower MaxRows).
template <int MaxRows = kMaxTileRows, typename Tile>
inline void for_each_row_tile(int64_t rows, Tile&& tile) {
  const int64_t tiles = (rows + MaxRows - 1) / MaxRows;
  int64_t done = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t left = tiles - t;
    const int64_t n = t == 0 ? std::min<int64_t>(MaxRows, rows) : (rows - done + left - 1) / left;
    tile(done, n);
    done += n;
  }
}

inline void rows_by_panel(const float* x, int64_t ldx, const float* panel, int64_t k_len, const float* bias,
                          float* out, int64_t ldo, int64_t cols, int64_t rows, bool accumulate) {
  for_each_row_tile(rows, [&](int64_t done, int64_t n) {
    kTiles[n - 1](x + done * ldx, ldx, panel, k_len, bias, out + done * ldo, ldo, cols, accumulate);
  });
}

// item(panel, first row, rows, first column, columns) for every (panel, row chunk) of a
// [rows, n] output, on torch's intra-op threads; consecutive items of a thread share a panel,
// so its weights are read from memory once per thread. Shared by the fp32 and bf16 matmuls.
template <typename Item>
inline void for_each_panel_item(int64_t rows, int64_t panels, int64_t n, Item&& item) {
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  torch::stable::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / chunks, c = i % chunks;
      const int64_t row0 = c * chunk_rows, col0 = p * kPanel;
      item(p, row0, std::min(chunk_rows, rows - row0), col0, std::min(kPanel, n - col0));
    }
  });
}

// What a panel matmul reads and writes; the caller has checked every shape.
struct PanelMatmul {
  const float* x;       // [rows, k_len], row stride ldx, last dim contiguous
  int64_t ldx;
  int64_t rows;
  const float* packed;  // [panels, k_len, kPanel]
  int64_t panels;
  int64_t k_len;
  const float* bias;    // [n], or nullptr
  float* out;           // [rows, n], row stride ldo
  int64_t ldo;
  int64_t n;
};

// Checks one linear's tensors and returns its problem: out [rows, n] contiguous (written),
// x [rows, k] with a contiguous last dim, packed [panels, k, kPanel] contiguous (columns past
// n zero), bias [n] contiguous or empty for none; all float32 on the CPU. `what` names the op.
inline PanelMatmul panel_problem(const char* what, const torch::stable::Tensor& out, const torch::stable::Tensor& x,
                                 const torch::stable::Tensor& packed, const torch::stable::Tensor& bias) {
  using torch::headeronly::ScalarType;
  for (const torch::stable::Tensor* t : {&out, &x, &packed, &bias}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float, what,
                    ": out, x, packed and bias must be float32 CPU tensors");
  }
  STD_TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), what,
                  ": packed must be a contiguous [panels, in_features, ", kPanel, "] weight");
  const int64_t panels = packed.size(0), k_len = packed.size(1);
  STD_TORCH_CHECK(x.dim() == 2 && x.size(1) == k_len && x.stride(1) == 1, what, ": x must be [rows, ", k_len,
                  "] with a contiguous last dim");
  const int64_t rows = x.size(0);
  STD_TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.is_contiguous(), what, ": out must be a contiguous [",
                  rows, ", out_features] tensor");
  const int64_t n = out.size(1);
  STD_TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, what, ": out has ", n,
                  " columns but packed holds ", panels, " panels of ", kPanel);
  STD_TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous()), what,
                  ": bias must be empty or a contiguous [", n, "]");
  return PanelMatmul{x.const_data_ptr<float>(), x.stride(0), rows, packed.const_data_ptr<float>(), panels, k_len,
                     bias.numel() ? bias.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(), n, n};
}

// out = x @ weight.T + bias, or out += it with `accumulate`, on torch's intra-op threads over
// (panel, row chunk) items; consecutive items of a thread share a panel, so its weights are
// read from memory once per thread.
inline void panel_matmul(const PanelMatmul& m, bool accumulate) {
  if (m.rows == 0 || m.n == 0) return;
  for_each_panel_item(m.rows, m.panels, m.n, [&](int64_t p, int64_t row0, int64_t nrows, int64_t col0, int64_t cols) {
    rows_by_panel(m.x + row0 * m.ldx, m.ldx, m.packed + p * m.k_len * kPanel, m.k_len, m.bias ? m.bias + col0 : nullptr,
                  m.out + row0 * m.ldo + col0, m.ldo, cols, nrows, accumulate);
  });
}

}  // namespace
