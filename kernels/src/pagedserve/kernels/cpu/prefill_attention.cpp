// CPU prefill (causal) paged attention: several query tokens per sequence, K/V read in place
// from the paged cache through the block table (no gather copy), fp32 arithmetic over an
// fp32 or bf16 cache.
//
// Op: pagedserve_cpu::paged_prefill_attention(out, query, key_cache, value_cache,
//     block_tables, seq_lens, query_starts, query_lens, scale) -> ()
//   out, query:   [T, H, D] float32, head_dim contiguous (out is written in place, only at
//                 the prefill rows)
//   key_cache, value_cache: [num_blocks, block_size, KVH, D] contiguous, both float32 or both
//                 bfloat16 (a bf16 tile's K and V rows are widened exactly into per-thread
//                 scratch, once per item and tile: 1 / 48 of the multiply-adds that read them)
//   block_tables: [S, max_blocks] int32, contiguous; seq_lens, query_lens: [S] int32;
//   query_starts: [S] int64. Sequence s's queries are rows query_starts[s] .. + query_lens[s]
//   of the batch; query j sits at position seq_lens[s] - query_lens[s] + j and sees keys
//   0 .. that position (a cached prefix or earlier chunk is simply the first keys).
//
// Rows: the G = H / KVH query heads sharing a kv head are flattened with the query tokens
// into rows r = token * G + head, and a work item is (sequence, kv head, kRows = 48
// consecutive rows), i.e. 16 tokens at G = 3. Every row of an item reads the same K and V,
// so each key is loaded once per item for 48 rows, whatever G is (MHA, GQA, MQA).
//
// Layout: the item's rows live in the SIMD lanes. The scaled queries are transposed once
// per item into qt[D][kRows]; scores are computed key-major, s[key][rows] = sum_d
// k[key][d] * qt[d][rows], one broadcast of a cache element against kRV row vectors per
// FMA group, so K is read in place and never transposed. The accumulator is transposed
// too, acc[D][rows] += v[key][d] * p[key][rows], again a broadcast of a cache element. The
// online softmax's per-row max, sum and rescale are then plain vector ops across rows (no
// horizontal reductions), and only the final 1 / sum and the output are written row-wise.
// Register blocks of 8 keys (or 8 head_dim columns) x 3 row vectors = 24 accumulators.
//
// Keys are walked kTileKeys at a time (flash-style online softmax); an item stops at its
// last row's causal limit, and only the tiles that cross some row's limit are masked.
// Masked keys get probability exactly 0, and keys past the limit are never loaded, so
// stale inf/NaN in unused cache slots cannot reach the output.
//
// Threads: items are sorted by key count (longest first) and handed out from an atomic
// counter inside one torch::stable::parallel_for (torch's intra-op threads). Each item is
// computed whole by one thread in a fixed order, so results do not depend on the thread
// count. Stable ABI only, like paged_attention.cpp (fast JIT build, no OpenMP).
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention_checks.h"
#include "vec.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Register blocks, in the build's native vectors (vec.h vnat: a 16-float vfloat array kept
// across a loop is spilled to the stack by GCC wherever it spans several registers, which
// made the AVX2 build 7x slower than the AVX-512 one). kBlk keys (scores) or head_dim
// columns (P @ V) x kNV row vectors of accumulators must fit the register file with the
// kNV operand vectors and a broadcast: 8 x 3 + 3 + 1 of 32 zmm (AVX-512), 6 x 2 + 2 + 1 of
// 16 ymm (AVX2), 6 x 4 + 4 + 1 of 32 (NEON), 2 x 4 + 4 + 1 of 16 (SSE2). Which rows share an
// item never changes a row's arithmetic (each lane is its own row), so every ISA computes
// the same per-row sums in the same order.
#if defined(__AVX512F__)
constexpr int kRV = 3;  // 16-float row vectors per item
constexpr int kBlk = 8;
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int kRV = 1;
constexpr int kBlk = 6;
#else
constexpr int kRV = 1;
constexpr int kBlk = 2;
#endif
constexpr int64_t kRows = kRV * kW;    // rows (token x query head) per item
constexpr int kNV = kRows / kNW;       // native vectors per item's rows
constexpr int64_t kTileKeys = 32;      // keys per online-softmax step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// x in every lane. splat_nat's initializer is the same broadcast; x - 0 is x for every x and
// folds into the FMA's embedded broadcast from memory on AVX-512.
inline vnat bcast(float x) { return x - vnat{}; }

// s[j][0:kRows] = sum_d k[j][d] * qt[d][0:kRows] for the N keys j (rows of the cache).
template <int N>
void scores_block(const float* const* k, const float* qt, int64_t head_dim, float* s) {
  const float* kr[N];
  for (int j = 0; j < N; ++j) kr[j] = k[j];
  vnat acc[N][kNV] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    vnat q[kNV];
    for (int c = 0; c < kNV; ++c) q[c] = load_nat(qt + d * kRows + c * kNW);
    for (int j = 0; j < N; ++j) {
      const vnat kj = bcast(kr[j][d]);
      for (int c = 0; c < kNV; ++c) acc[j][c] += kj * q[c];
    }
  }
  for (int j = 0; j < N; ++j) {
    for (int c = 0; c < kNV; ++c) store_nat(s + j * kRows + c * kNW, acc[j][c]);
  }
}

// acc[d0 + i][0:kRows] = acc[d0 + i] * alpha + sum_{j < nk} v[j][d0 + i] * p[j][0:kRows]
// for the N columns i: the online softmax's rescale folded into the P @ V pass.
template <int N>
void pv_block(const float* const* v, int64_t d0, const float* p, int64_t nk, const float* alpha, float* acc) {
  vnat a[N][kNV];
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < kNV; ++c) {
      a[i][c] = load_nat(acc + (d0 + i) * kRows + c * kNW) * load_nat(alpha + c * kNW);
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    vnat pj[kNV];
    for (int c = 0; c < kNV; ++c) pj[c] = load_nat(p + j * kRows + c * kNW);
    const float* vj = v[j] + d0;
    for (int i = 0; i < N; ++i) {
      const vnat vi = bcast(vj[i]);
      for (int c = 0; c < kNV; ++c) a[i][c] += vi * pj[c];
    }
  }
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < kNV; ++c) store_nat(acc + (d0 + i) * kRows + c * kNW, a[i][c]);
  }
}

// Blocks of 1 .. kBlk, so ragged key tiles and any head_dim use the same register code.
using ScoresFn = void (*)(const float* const*, const float*, int64_t, float*);
using PvFn = void (*)(const float* const*, int64_t, const float*, int64_t, const float*, float*);
template <int... I>
constexpr std::array<ScoresFn, kBlk> scores_fns(std::integer_sequence<int, I...>) {
  return {&scores_block<I + 1>...};
}
template <int... I>
constexpr std::array<PvFn, kBlk> pv_fns(std::integer_sequence<int, I...>) {
  return {&pv_block<I + 1>...};
}
constexpr std::array<ScoresFn, kBlk> kScores = scores_fns(std::make_integer_sequence<int, kBlk>{});
constexpr std::array<PvFn, kBlk> kPv = pv_fns(std::make_integer_sequence<int, kBlk>{});

struct Problem : PagedLayout {
  const char* key_cache;  // float or bf16 elements (bf16 true)
  const char* value_cache;
  bool bf16;
  const int64_t* query_starts;
  const int32_t* query_lens;
};

struct Item {
  int64_t seq;
  int64_t kv_head;
  int64_t row0;    // first flattened row (token * G + query head) of the sequence
  int64_t kv_end;  // keys the item reads: its last row's position + 1
};

// Per-thread scratch: transposed scaled queries [D][kRows], one tile's scores /
// probabilities [kTileKeys][kRows], the transposed accumulator [D][kRows] and the tile's
// K and V row pointers (into the cache, or for a bf16 cache into the widened tile rows).
struct Scratch {
  std::vector<float> qt, s, acc, k_wide, v_wide;
  std::array<const float*, kTileKeys> k_rows{}, v_rows{};
  Scratch(int64_t head_dim, bool bf16)
      : qt(head_dim * kRows),
        s(kTileKeys * kRows),
        acc(head_dim * kRows),
        k_wide(bf16 ? kTileKeys * head_dim : 0),
        v_wide(bf16 ? kTileKeys * head_dim : 0) {}
};

void attend_item(const Problem& p, const Item& it, Scratch& scratch) {
  const int64_t D = p.head_dim;
  const int64_t G = p.group;
  const int64_t s = it.seq;
  const int64_t q_len = p.query_lens[s];
  const int64_t first_pos = p.seq_lens[s] - q_len;
  const int64_t nrows = std::min(kRows, q_len * G - it.row0);
  float* qt = scratch.qt.data();
  float* sc = scratch.s.data();
  float* acc = scratch.acc.data();

  // Transposed scaled queries; padding rows are zero queries at the last row's position
  // (they see every key the item reads, so their softmax is well defined; never written).
  alignas(64) int32_t pos[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t flat = it.row0 + std::min(r, nrows - 1);
    pos[r] = static_cast<int32_t>(first_pos + flat / G);
    if (r < nrows) {
      const float* src = p.query + (p.query_starts[s] + flat / G) * p.q_stride_t +
                         (it.kv_head * G + flat % G) * p.q_stride_h;
      for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = src[d] * p.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = 0.0f;
    }
  }
  vint pos_v[kRV];
  std::memcpy(pos_v, pos, sizeof(pos_v));
  const int64_t min_pos = pos[0];

  const vfloat neg_inf = splat(-std::numeric_limits<float>::infinity());
  vfloat m[kRV], l[kRV];
  for (int c = 0; c < kRV; ++c) {
    m[c] = neg_inf;
    l[c] = vfloat{};
  }
  std::fill(acc, acc + D * kRows, 0.0f);

  const int64_t row_stride = p.num_kv_heads * D;
  const int32_t* table = p.block_tables + s * p.max_blocks;
  const int64_t head_offset = it.kv_head * D;
  for (int64_t k0 = 0; k0 < it.kv_end; k0 += kTileKeys) {
    const int64_t nk = std::min(kTileKeys, it.kv_end - k0);
    // The tile's row pointers, walking the block table (no division per key: at block
    // size 1 every key is its own block).
    int64_t b = k0 / p.block_size, off = k0 % p.block_size;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = static_cast<int64_t>(table[b]) * p.block_size + off;
      const int64_t elem = slot * row_stride + head_offset;
      if (p.bf16) {
        float* kw = scratch.k_wide.data() + j * D;
        float* vw = scratch.v_wide.data() + j * D;
        widen_bf16(reinterpret_cast<const uint16_t*>(p.key_cache) + elem, kw, D);
        widen_bf16(reinterpret_cast<const uint16_t*>(p.value_cache) + elem, vw, D);
        scratch.k_rows[j] = kw;
        scratch.v_rows[j] = vw;
      } else {
        scratch.k_rows[j] = reinterpret_cast<const float*>(p.key_cache) + elem;
        scratch.v_rows[j] = reinterpret_cast<const float*>(p.value_cache) + elem;
      }
      if (++off == p.block_size) {
        off = 0;
        ++b;
      }
    }
    for (int64_t j = 0; j < nk; j += kBlk) {
      kScores[std::min<int64_t>(kBlk, nk - j) - 1](scratch.k_rows.data() + j, qt, D, sc + j * kRows);
    }

    // Online softmax, vectorised across rows. Only a tile reaching past some row's causal
    // limit needs the mask; there a masked key's probability is set to exactly 0.
    const bool masked = k0 + nk - 1 > min_pos;
    alignas(64) float alpha[kRows];  // the rows' rescale of what the tile adds to
    for (int c = 0; c < kRV; ++c) {
      vfloat tile_max = neg_inf;
      for (int64_t j = 0; j < nk; ++j) {
        vfloat x = load(sc + j * kRows + c * kW);
        if (masked) {
          const int32_t key = static_cast<int32_t>(k0 + j);
          x = lanewise([key](auto pos, auto v) { return pos < key ? decltype(v){} + kNegInf : v; }, pos_v[c], x);
          store(sc + j * kRows + c * kW, x);
        }
        tile_max = greater_of(x, tile_max);
      }
      // Key 0 is in every row's range and in the first tile, so m is finite from then on.
      const vfloat m_new = greater_of(m[c], tile_max);
      const vfloat rescale = exp_nonpositive(m[c] - m_new);
      store(alpha + c * kW, rescale);
      m[c] = m_new;
      vfloat sum = {};
      for (int64_t j = 0; j < nk; ++j) {
        const vfloat x = load(sc + j * kRows + c * kW);
        vfloat e = exp_nonpositive(x - m_new);
        if (masked) e = lanewise([](auto v, auto ev) { return v == kNegInf ? decltype(ev){} : ev; }, x, e);
        store(sc + j * kRows + c * kW, e);
        sum += e;
      }
      l[c] = l[c] * rescale + sum;
    }

    for (int64_t d0 = 0; d0 < D; d0 += kBlk) {
      kPv[std::min<int64_t>(kBlk, D - d0) - 1](scratch.v_rows.data(), d0, sc, nk, alpha, acc);
    }
  }

  alignas(64) float inv[kRows];
  for (int c = 0; c < kRV; ++c) store(inv + c * kW, splat(1.0f) / l[c]);
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t flat = it.row0 + r;
    float* dst = p.out + (p.query_starts[s] + flat / G) * p.out_stride_t + (it.kv_head * G + flat % G) * p.out_stride_h;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d * kRows + r] * inv[r];
  }
}

void run(const Problem& p, int64_t num_seqs) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = static_cast<int64_t>(p.query_lens[s]) * p.group;
    const int64_t first_pos = p.seq_lens[s] - p.query_lens[s];
    for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
      const int64_t last = std::min(rows, row0 + kRows) - 1;
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({s, h, row0, first_pos + last / p.group + 1});
    }
  }
  // Most keys first, so the long items start early and short ones fill in at the end.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.kv_end > b.kv_end; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads, num_items));
  torch::stable::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    Scratch scratch(p.head_dim, p.bf16);
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_items) break;
      attend_item(p, items[i], scratch);
    }
  });
}

void paged_prefill_attention(
    Tensor out,
    Tensor query,
    Tensor key_cache,
    Tensor value_cache,
    Tensor block_tables,
    Tensor seq_lens,
    Tensor query_starts,
    Tensor query_lens,
    double scale) {
  check_query_and_caches(out, query, key_cache, value_cache, "paged_prefill_attention");
  for (const Tensor* t : {&out, &query}) {
    STD_TORCH_CHECK(t->scalar_type() == ScalarType::Float, "paged_prefill_attention: query and out must be float32");
  }
  const ScalarType cache_type = key_cache.scalar_type();
  STD_TORCH_CHECK((cache_type == ScalarType::Float || cache_type == ScalarType::BFloat16) &&
                      value_cache.scalar_type() == cache_type,
                  "paged_prefill_attention supports float32 or bfloat16 caches (both of one dtype)");
  STD_TORCH_CHECK(std::isfinite(scale), "scale must be finite");
  const int64_t num_seqs = check_block_tables(block_tables);
  check_int_vector(seq_lens, ScalarType::Int, num_seqs, "seq_lens must be a contiguous int32 [S] CPU tensor");
  check_int_vector(query_lens, ScalarType::Int, num_seqs, "query_lens must be a contiguous int32 [S] CPU tensor");
  check_int_vector(query_starts, ScalarType::Long, num_seqs,
                   "query_starts must be a contiguous int64 [S] CPU tensor");

  Problem p{};
  static_cast<PagedLayout&>(p) = paged_layout(out, query, key_cache, block_tables, seq_lens, scale);
  // Validate the indices up front (a few hundred ints), so the hot loop needs no checks.
  const int64_t num_tokens = query.size(0);
  const int32_t* q_lens = query_lens.const_data_ptr<int32_t>();
  const int64_t* starts = query_starts.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = check_sequence(p, s, key_cache.size(0));
    const int64_t q_len = q_lens[s];
    STD_TORCH_CHECK(q_len >= 1 && q_len <= len, "query_lens[", s, "] = ", q_len, " out of range");
    STD_TORCH_CHECK(starts[s] >= 0 && starts[s] + q_len <= num_tokens, "query_starts[", s, "] = ", starts[s],
                    " out of range");
  }
  if (num_seqs == 0) {
    return;
  }

  p.key_cache = static_cast<const char*>(key_cache.const_data_ptr());
  p.value_cache = static_cast<const char*>(value_cache.const_data_ptr());
  p.bf16 = cache_type == ScalarType::BFloat16;
  p.query_starts = starts;
  p.query_lens = q_lens;
  run(p, num_seqs);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, float scale) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("paged_prefill_attention", TORCH_BOX(&paged_prefill_attention));
}
