// CPU KV-cache write (fp32 or bf16 cache): each new token's key and value rows into its slot.
//
// Op: pagedserve_cpu::write_kv_cache(key_cache, value_cache, key, value, slot_mapping) -> ()
//   key_cache, value_cache: [num_blocks, block_size, KVH, D] contiguous (written), both float32
//                           (a copy) or both bfloat16 (rounded to nearest even, as torch's
//                           fp32 -> bf16 cast)
//   key, value:             [T, KVH, D] float32, head_dim contiguous (any token/head strides:
//                           the fused layers pass views into one qkv projection output)
//   slot_mapping:           [T] int64, slot = block * block_size + offset; every slot is
//                           checked to be in range before anything is written
//
// Why: torch's path is two index_copy_ calls per layer behind Python checks; at decode row
// counts that dispatch costs more than the copy (a few KB per layer). FP8 caches quantize on
// write and stay on the torch path.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

void write_kv_cache(Tensor key_cache, Tensor value_cache, Tensor key, Tensor value, Tensor slot_mapping) {
  for (const Tensor* t : {&key, &value}) {
    STD_TORCH_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Float,
                    "write_kv_cache: key and value must be float32 CPU tensors");
  }
  const ScalarType cache_type = key_cache.scalar_type();
  STD_TORCH_CHECK(key_cache.is_cpu() && value_cache.is_cpu() && value_cache.scalar_type() == cache_type &&
                      (cache_type == ScalarType::Float || cache_type == ScalarType::BFloat16),
                  "write_kv_cache: the caches must be float32 or bfloat16 CPU tensors, both of one dtype");
  STD_TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
                  "caches must be contiguous [num_blocks, block_size, KVH, D]");
  for (int64_t i = 0; i < 4; ++i) {
    STD_TORCH_CHECK(value_cache.size(i) == key_cache.size(i), "value_cache shape != key_cache shape");
  }
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t tokens = key.dim() == 3 ? key.size(0) : -1;
  for (const Tensor* t : {&key, &value}) {
    STD_TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == kv_heads && t->size(2) == dim &&
                        t->stride(2) == 1,
                    "key and value must be [T, ", kv_heads, ", ", dim, "] with a contiguous head_dim");
  }
  STD_TORCH_CHECK(slot_mapping.is_cpu() && slot_mapping.scalar_type() == ScalarType::Long &&
                      slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.is_contiguous(),
                  "slot_mapping must be a contiguous int64 [", tokens, "]");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    STD_TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                    " is not a slot of the cache (", num_slots, " slots)");
  }
  const float* kp = key.const_data_ptr<float>();
  const float* vp = value.const_data_ptr<float>();
  const int64_t kts = key.stride(0), khs = key.stride(1), vts = value.stride(0), vhs = value.stride(1);
  const int64_t row = kv_heads * dim;
  if (cache_type == ScalarType::BFloat16) {
    uint16_t* kc = static_cast<uint16_t*>(key_cache.mutable_data_ptr());
    uint16_t* vc = static_cast<uint16_t*>(value_cache.mutable_data_ptr());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        narrow_bf16(kp + t * kts + h * khs, kc + slots[t] * row + h * dim, dim);
        narrow_bf16(vp + t * vts + h * vhs, vc + slots[t] * row + h * dim, dim);
      }
    }
    return;
  }
  float* kc = key_cache.mutable_data_ptr<float>();
  float* vc = value_cache.mutable_data_ptr<float>();
  const size_t head_bytes = static_cast<size_t>(dim) * sizeof(float);
  for (int64_t t = 0; t < tokens; ++t) {
    float* kd = kc + slots[t] * row;
    float* vd = vc + slots[t] * row;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(kd + h * dim, kp + t * kts + h * khs, head_bytes);
      std::memcpy(vd + h * dim, vp + t * vts + h * vhs, head_bytes);
    }
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) { m.impl("write_kv_cache", TORCH_BOX(&write_kv_cache)); }
