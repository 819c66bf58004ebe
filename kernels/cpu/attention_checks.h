// Input checks shared by the C++ paged-attention kernels: paged_attention.cpp (decode tokens)
// and prefill_attention.cpp (prefill chunks). Both read [T, H, D] queries and the paged
// [num_blocks, block_size, KVH, D] caches through per-sequence int32 block tables, and both
// validate every index before the hot loop so that it needs no checks.
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

}  // namespace
