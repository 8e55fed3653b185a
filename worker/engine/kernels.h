// The engine's C++ CPU kernels, one extension (native.py builds these sources together;
// kernels_module.cpp binds them): the 8-bit-activation products (q8_kernels.cpp), the row
// kernels of a decode step (row_kernels.cpp) and the whole stack of decoder layers for a step of
// decode rows (decode_layers.cpp), which calls the others directly.
#pragma once
#include <torch/extension.h>
#include <string>
#include <tuple>
#include <vector>

namespace llm_stream {

// q8_kernels.cpp
torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                        const torch::Tensor& zeros, const c10::optional<torch::Tensor>& bias);
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
std::string instruction_set();
void set_instruction_set(const std::string& name);

// row_kernels.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& rows, const torch::Tensor& keys, const torch::Tensor& values,
                         int64_t heads, int64_t kv_heads);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& table, const torch::Tensor& starts, const torch::Tensor& ends,
                               int64_t block_size, double scale);

// decode_layers.cpp
// A projection as decoder.py's `projection` runs it (quantize.int4_linear's order): the dense
// weight from `dense_from_rows` rows (nn.Linear: always), else the 8-bit-activation kernel below
// `q8_below_rows`, else torch's 4-bit kernel; then the bias.
using ProjectionArgs = std::tuple<c10::optional<torch::Tensor>, int64_t,                       // dense, from rows
                                  c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,  // packed, scales_zeros
                                  c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,  // 8-bit: packed, scales
                                  c10::optional<torch::Tensor>, int64_t,                       // zeros, below rows
                                  c10::optional<torch::Tensor>>;                               // bias

struct Projection {
  torch::Tensor dense, packed, scales_zeros, q8_packed, q8_scales, q8_zeros;
  int64_t dense_from_rows = 0, q8_below_rows = 0;
  c10::optional<torch::Tensor> bias;
  explicit Projection(const ProjectionArgs& args);
  torch::Tensor operator()(const torch::Tensor& x) const;
};

struct DecoderLayer {
  torch::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Projection qkv, o_proj, gate_up, down;
  int64_t heads, kv_heads, head_dim, inter;
  double scaling;
};

class DecodeLayers {
 public:
  void add_layer(const torch::Tensor& input_norm, double input_eps, const torch::Tensor& post_norm, double post_eps,
                 const ProjectionArgs& qkv, const ProjectionArgs& o_proj, const ProjectionArgs& gate_up,
                 const ProjectionArgs& down, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                 double scaling);
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& write_rows, const std::vector<torch::Tensor>& keys,
                        const std::vector<torch::Tensor>& values, const torch::Tensor& table,
                        const torch::Tensor& starts, const torch::Tensor& ends, int64_t block_size) const;

 private:
  std::vector<DecoderLayer> layers_;
};

}  // namespace llm_stream
