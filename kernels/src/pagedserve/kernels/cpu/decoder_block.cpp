// A decoder layer's work before and after attention, each as one op (CPU, fp32 activations;
// each linear's weight fp32, bf16 or quantized panels).
//
// Ops (pagedserve_cpu::):
//   decoder_attention_input(hidden, norm_weight, eps, qkv_packed, qkv_bias, qkv_features, cos,
//                           sin, rotary_heads, int8_activations=False) -> Tensor qkv [T, qkv_features]
//       qkv = rms_norm(hidden) @ W_qkv.T + b_qkv, then rotary (neox) in place on the first
//       `rotary_heads` heads of each row: q and k side by side, v after them unrotated.
//   decoder_mlp(hidden, attn, o_packed, o_bias, norm_weight, eps, gate_up_packed, gate_up_bias,
//               intermediate_size, down_packed, down_bias, int8_activations=False) -> ()
//       hidden += attn @ W_o.T + b_o; x = rms_norm(hidden); gu = x @ W_gate_up.T + b;
//       hidden += (silu(gu[:, :I]) * gu[:, I:]) @ W_down.T + b_down; hidden in place.
//
// hidden: [T, H] float32, contiguous; norm weights [H]; *_packed: panel-packed weights, each
// fp32 (kernels/src/pagedserve/kernels/linear.py pack_panels), bf16 (pack_panels_bf16) or quantized
// (kernels/src/pagedserve/kernels/quant.py pack_quant_panels), biases [N] or empty; cos, sin: [T, head_dim] contiguous;
// attn: [T, heads * head_dim] with a contiguous last dim; int8_activations: the quantized
// linears multiply by integer dot products (panel_quant.h; the others ignore it).
//
// Why: in a decode step the work between a layer's matmuls is small, and calling it from
// Python as ten ops per layer (norm, linear, rotary, linear, add + norm, linear, SiLU,
// linear, add, with their allocations and views) cost ~5 ms of a ~75 ms step on the default
// model (measured on a 30-layer model with tiny dimensions, where the step is nearly all
// overhead). Here each half of the layer is one call.
//
// Results: the same row kernels (row_ops.h) and panel matmuls (panel.h, panel_bf16.h) in the
// same order as the separate ops (layer_ops.cpp, linear.cpp, linear_bf16.cpp), and the residual adds are the matmul's
// accumulate mode (out + (acc + bias), the IEEE adds of `hidden += linear(x)`): bit-identical
// to the op-by-op path (tested).
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

#include "panel.h"
#include "panel_bf16.h"
#include "panel_quant.h"
#include "row_ops.h"

namespace {

using torch::stable::Tensor;

// hidden: a contiguous [T, H] float32 tensor; returns H.
int64_t check_hidden(const Tensor& hidden) {
  STD_TORCH_CHECK(hidden.is_cpu() && hidden.scalar_type() == torch::headeronly::ScalarType::Float &&
                      hidden.dim() == 2 && hidden.is_contiguous(),
                  "hidden must be a contiguous float32 CPU [tokens, hidden_size] tensor");
  return hidden.size(1);
}

// One linear of the layer: an fp32, a bf16 or a quantized panel matmul, by its packed
// weight's dtype (float32, bfloat16, uint8 / int8).
struct LayerLinear {
  enum class Kind { kF32, kBf16, kQuant } kind;
  PanelMatmul f32;
  PanelMatmulBf16 b16;
  QuantMatmul quant;
};

LayerLinear linear_problem(const char* what, const Tensor& out, const Tensor& x, const Tensor& packed,
                           const Tensor& bias, bool int8_activations) {
  if (packed.scalar_type() == torch::headeronly::ScalarType::BFloat16) {
    return LayerLinear{LayerLinear::Kind::kBf16, {}, panel_problem_bf16(what, out, x, packed, bias), {}};
  }
  if (is_quantized(packed)) {
    return LayerLinear{LayerLinear::Kind::kQuant, {}, {}, quant_problem(what, out, x, packed, bias, int8_activations)};
  }
  return LayerLinear{LayerLinear::Kind::kF32, panel_problem(what, out, x, packed, bias), {}, {}};
}

void run_linear(const LayerLinear& l, bool accumulate) {
  switch (l.kind) {
    case LayerLinear::Kind::kBf16:
      panel_matmul_bf16(l.b16, accumulate);
      break;
    case LayerLinear::Kind::kQuant:
      quant_matmul(l.quant, accumulate);
      break;
    case LayerLinear::Kind::kF32:
      panel_matmul(l.f32, accumulate);
      break;
  }
}

Tensor decoder_attention_input(Tensor hidden, Tensor norm_weight, double eps, Tensor qkv_packed, Tensor qkv_bias,
                               int64_t qkv_features, Tensor cos, Tensor sin, int64_t rotary_heads,
                               bool int8_activations) {
  const int64_t h = check_hidden(hidden);
  const int64_t tokens = hidden.size(0);
  check_weight(norm_weight, h);
  const int64_t dim = cos.dim() == 2 ? cos.size(1) : 0;
  STD_TORCH_CHECK(dim > 0 && dim % 2 == 0, "cos must be [tokens, head_dim] with an even head_dim");
  check_rotary_tables(cos, sin, tokens, dim);
  STD_TORCH_CHECK(qkv_features > 0, "qkv_features must be positive, got ", qkv_features);
  Tensor normed = torch::stable::new_empty(hidden, {tokens, h});
  Tensor qkv = torch::stable::new_empty(hidden, {tokens, qkv_features});
  // Every shape is checked before any work, as in decoder_mlp.
  const LayerLinear m = linear_problem("decoder_attention_input", qkv, normed, qkv_packed, qkv_bias, int8_activations);
  STD_TORCH_CHECK(rotary_heads >= 0 && rotary_heads * dim <= qkv_features, "rotary_heads (", rotary_heads, ") x head_dim (",
                  dim, ") exceeds the ", qkv_features, " q/k/v columns");
  norm_rows(normed.mutable_data_ptr<float>(), h, hidden.const_data_ptr<float>(), h, norm_weight.const_data_ptr<float>(),
            tokens, h, static_cast<float>(eps));
  run_linear(m, /*accumulate=*/false);
  rotate_heads(qkv.mutable_data_ptr<float>(), qkv_features, dim, tokens, rotary_heads, cos.const_data_ptr<float>(),
               sin.const_data_ptr<float>(), dim);
  return qkv;
}

void decoder_mlp(Tensor hidden, Tensor attn, Tensor o_packed, Tensor o_bias, Tensor norm_weight, double eps,
                 Tensor gate_up_packed, Tensor gate_up_bias, int64_t intermediate_size, Tensor down_packed,
                 Tensor down_bias, bool int8_activations) {
  const int64_t h = check_hidden(hidden);
  const int64_t tokens = hidden.size(0);
  check_weight(norm_weight, h);
  STD_TORCH_CHECK(intermediate_size > 0, "intermediate_size must be positive, got ", intermediate_size);
  const int64_t inter = intermediate_size;
  Tensor normed = torch::stable::new_empty(hidden, {tokens, h});
  Tensor gate_up = torch::stable::new_empty(hidden, {tokens, 2 * inter});
  Tensor act = torch::stable::new_empty(hidden, {tokens, inter});
  // Every shape is checked before hidden is touched: a refused call changes nothing.
  const LayerLinear o = linear_problem("decoder_mlp (o_proj)", hidden, attn, o_packed, o_bias, int8_activations);
  const LayerLinear gu = linear_problem("decoder_mlp (gate_up_proj)", gate_up, normed, gate_up_packed, gate_up_bias,
                                         int8_activations);
  const LayerLinear down = linear_problem("decoder_mlp (down_proj)", hidden, act, down_packed, down_bias, int8_activations);

  run_linear(o, /*accumulate=*/true);  // hidden += attn @ W_o.T + b_o
  norm_rows(normed.mutable_data_ptr<float>(), h, hidden.const_data_ptr<float>(), h, norm_weight.const_data_ptr<float>(),
            tokens, h, static_cast<float>(eps));
  run_linear(gu, /*accumulate=*/false);
  silu_mul_rows(act.mutable_data_ptr<float>(), inter, gate_up.const_data_ptr<float>(), 2 * inter, tokens, inter);
  run_linear(down, /*accumulate=*/true);  // hidden += act @ W_down.T + b_down
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(PAGEDSERVE_OPS, m) {
  m.def(
      "decoder_attention_input(Tensor hidden, Tensor norm_weight, float eps, Tensor qkv_packed, Tensor qkv_bias, "
      "int qkv_features, Tensor cos, Tensor sin, int rotary_heads, bool int8_activations=False) -> Tensor");
  m.def(
      "decoder_mlp(Tensor(a!) hidden, Tensor attn, Tensor o_packed, Tensor o_bias, Tensor norm_weight, float eps, "
      "Tensor gate_up_packed, Tensor gate_up_bias, int intermediate_size, Tensor down_packed, Tensor down_bias, "
      "bool int8_activations=False) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(PAGEDSERVE_OPS, CPU, m) {
  m.impl("decoder_attention_input", TORCH_BOX(&decoder_attention_input));
  m.impl("decoder_mlp", TORCH_BOX(&decoder_mlp));
}
