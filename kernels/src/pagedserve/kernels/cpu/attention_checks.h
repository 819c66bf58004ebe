// Input checks and the common input layout of the C++ paged-attention kernels:
// paged_attention.cpp (decode tokens) and prefill_attention.cpp (prefill chunks). Both read
// [T, H, D] queries and the paged [num_blocks, block_size, KVH, D] caches through
// per-sequence int32 block tables, and both validate every index before the hot loop so that
// it needs no checks.
//
// Header-only and internal to the extension (an unnamed namespace, like vec.h); the sources
// include torch's stable headers, which define Tensor and STD_TORCH_CHECK, before this one.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace {

// out and query alike ([T, H, D], head_dim contiguous); both caches alike ([num_blocks,
// block_size, KVH, D], contiguous); all on the CPU; the heads a multiple of the KV heads.
inline void check_query_and_caches(const torch::stable::Tensor& out, const torch::stable::Tensor& query,
                                   const torch::stable::Tensor& key_cache, const torch::stable::Tensor& value_cache,
                                   const char* op) {
  STD_TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [T, H, D]");
  STD_TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, KVH, D]");
  for (int64_t i = 0; i < 4; ++i) {
    STD_TORCH_CHECK(value_cache.size(i) == key_cache.size(i), "value_cache shape != key_cache shape");
  }
  for (int64_t i = 0; i < 3; ++i) {
    STD_TORCH_CHECK(out.size(i) == query.size(i), "out shape != query shape");
  }
  for (const torch::stable::Tensor* t : {&out, &query, &key_cache, &value_cache}) {
    STD_TORCH_CHECK(t->is_cpu(), op, " is a CPU kernel");
  }
  STD_TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  STD_TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a contiguous head_dim");
  STD_TORCH_CHECK(query.size(2) == key_cache.size(3) && key_cache.size(3) > 0, "query head_dim != cache head_dim");
  STD_TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
                  "num_heads must be a multiple of KVH");
}

// A contiguous CPU vector of `type` and length n (what: the message naming it).
inline void check_int_vector(const torch::stable::Tensor& t, torch::headeronly::ScalarType type, int64_t n,
                             const char* what) {
  STD_TORCH_CHECK(t.dim() == 1 && t.scalar_type() == type && t.is_contiguous() && t.size(0) == n && t.is_cpu(),
                  what);
}

// The block tables: a contiguous int32 [S, max_blocks] CPU tensor; returns S.
inline int64_t check_block_tables(const torch::stable::Tensor& block_tables) {
  STD_TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::headeronly::ScalarType::Int &&
                      block_tables.is_contiguous() && block_tables.is_cpu(),
                  "block_tables must be a contiguous int32 [S, max_blocks] CPU tensor");
  return block_tables.size(0);
}

// Sequence s's first ceil(len / block_size) entries of its block-table row name blocks of the
// cache (the ones past them are never read).
inline void check_block_row(const int32_t* row, int64_t s, int64_t len, int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0, nb = (len + block_size - 1) / block_size; b < nb; ++b) {
    const int64_t block = row[b];
    STD_TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block,
                    " is not a block of the cache");
  }
}

// What both kernels read alike: out and query rows, the block tables and sequence lengths,
// and the cache shape. Each kernel's Problem extends it with its own inputs.
struct PagedLayout {
  float* out;
  const float* query;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  int64_t out_stride_t, out_stride_h;
  int64_t q_stride_t, q_stride_h;
  int64_t max_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t group;
  int64_t head_dim;
  float scale;
};

// The layout of inputs that passed check_query_and_caches, check_block_tables and the
// seq_lens check.
inline PagedLayout paged_layout(const torch::stable::Tensor& out, const torch::stable::Tensor& query,
                                const torch::stable::Tensor& key_cache, const torch::stable::Tensor& block_tables,
                                const torch::stable::Tensor& seq_lens, double scale) {
  PagedLayout l{};
  l.out = out.mutable_data_ptr<float>();
  l.query = query.const_data_ptr<float>();
  l.block_tables = block_tables.const_data_ptr<int32_t>();
  l.seq_lens = seq_lens.const_data_ptr<int32_t>();
  l.out_stride_t = out.stride(0);
  l.out_stride_h = out.stride(1);
  l.q_stride_t = query.stride(0);
  l.q_stride_h = query.stride(1);
  l.max_blocks = block_tables.size(1);
  l.block_size = key_cache.size(1);
  l.num_kv_heads = key_cache.size(2);
  l.group = query.size(1) / key_cache.size(2);
  l.head_dim = key_cache.size(3);
  l.scale = static_cast<float>(scale);
  return l;
}

// Sequence s's length fits its block-table row, and the blocks it reads are blocks of a cache
// of num_blocks; returns the length.
inline int64_t check_sequence(const PagedLayout& l, int64_t s, int64_t num_blocks) {
  const int64_t len = l.seq_lens[s];
  STD_TORCH_CHECK(len >= 1 && len <= l.max_blocks * l.block_size, "seq_lens[", s, "] = ", len, " out of range");
  check_block_row(l.block_tables + s * l.max_blocks, s, len, l.block_size, num_blocks);
  return len;
}

}  // namespace
