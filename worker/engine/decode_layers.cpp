// Every decoder layer of a step of decode rows in one call (decoder.py's `_Layer.__call__` on
// its CPU row-kernel path: the same operations in the same order), so that a step of one user
// pays one Python call for the whole stack instead of ~14 a layer: on a 2-core CPU those calls
// cost ~3 ms of a ~12 ms step. The products, norms, RoPE and attention are this extension's own
// kernels; the residual adds, SiLU and the gating product are ATen's own operations called from
// C++ (the same kernels on the same tensors as from Python, so the same bits: the engine's
// tokens still equal `model.generate`'s).
#include "kernels.h"
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>

namespace llm_stream {

namespace {
torch::Tensor given(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }
constexpr int64_t GROUP = 32;   // quantize.GROUP: input features per 4-bit scale
}  // namespace

Projection::Projection(const ProjectionArgs& a)
    : dense(given(std::get<0>(a))), packed(given(std::get<2>(a))), scales_zeros(given(std::get<3>(a))),   // made contiguous below, as int4_linear does
      q8_packed(given(std::get<4>(a))), q8_scales(given(std::get<5>(a))), q8_zeros(given(std::get<6>(a))),
      dense_from_rows(std::get<1>(a)), q8_below_rows(std::get<7>(a)), bias(std::get<8>(a)) {
  TORCH_CHECK(dense.defined() || packed.defined(), "a projection needs weights");
  if (scales_zeros.defined()) scales_zeros = scales_zeros.contiguous();
}

torch::Tensor Projection::operator()(const torch::Tensor& x) const {
  const int64_t rows = x.size(0);
  if (dense.defined() && (rows >= dense_from_rows || !packed.defined())) return at::linear(x, dense, bias);
  if (q8_packed.defined() && rows < q8_below_rows) return q4_linear(x, q8_packed, q8_scales, q8_zeros, bias);
  TORCH_CHECK(packed.defined(), "no 4-bit weights for this many rows");
  auto out = at::_weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros);
  return bias.has_value() ? at::add(out, *bias) : out;
}

void DecodeLayers::add_layer(const torch::Tensor& input_norm, double input_eps, const torch::Tensor& post_norm,
                             double post_eps, const ProjectionArgs& qkv, const ProjectionArgs& o_proj,
                             const ProjectionArgs& gate_up, const ProjectionArgs& down, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t inter, double scaling) {
  layers_.push_back(DecoderLayer{input_norm, post_norm, input_eps, post_eps, Projection(qkv), Projection(o_proj),
                                 Projection(gate_up), Projection(down), heads, kv_heads, head_dim, inter, scaling});
}

// h [T, hidden] (T decode rows: one token each); cos, sin [T, 1, D] at their positions;
// write_rows [T]: the pool rows of their new keys/values; keys, values: the per-layer pools;
// table [T, blocks], starts, ends [T]: the positions each row attends to (row_kernels.cpp).
// Returns the last layer's output, before the final norm.
torch::Tensor DecodeLayers::forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                                    const torch::Tensor& write_rows, const std::vector<torch::Tensor>& keys,
                                    const std::vector<torch::Tensor>& values, const torch::Tensor& table,
                                    const torch::Tensor& starts, const torch::Tensor& ends, int64_t block_size) const {
  TORCH_CHECK(keys.size() >= layers_.size() && values.size() >= layers_.size(), "a pool per layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h: contiguous [rows, hidden]");
  const int64_t rows = h.size(0);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer& layer = layers_[i];
    const auto qkv = layer.qkv(rms_norm(h, layer.input_norm, layer.input_eps));
    const auto q = rope_store(qkv, cos, sin, write_rows, keys[i], values[i], layer.heads, layer.kv_heads);
    const auto attended = decode_attention(q, keys[i], values[i], table, starts, ends, block_size, layer.scaling);
    h = at::add(h, layer.o_proj(attended.reshape({rows, layer.heads * layer.head_dim})));
    const auto gate_up = layer.gate_up(rms_norm(h, layer.post_norm, layer.post_eps));
    const auto parts = at::split_with_sizes(gate_up, {layer.inter, layer.inter}, -1);
    h = at::add(h, layer.down(at::mul(at::silu(parts[0]), parts[1])));
  }
  return h;
}

}  // namespace llm_stream
