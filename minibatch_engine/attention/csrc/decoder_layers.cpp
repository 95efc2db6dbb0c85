// A llama-family step's decoder layers as one C++ loop (runner/flat_forward.py).
//
// The flat forward calls the same kernels as the model's own forward, from Python:
// per layer two RMSNorms, four products over packed panels, the rotary embedding,
// paged attention, SwiGLU's activation and two residual adds, with the splits and
// views between them. At a decode step of a small model each of those Python calls
// costs more than its arithmetic. decoder_layers makes the same calls, in the same
// order, on the same tensors, from C++: the logits are bit-identical, only the
// interpreter is gone from between the kernels. The two residual adds are done in
// place (an elementwise add rounds the same whether it writes a new tensor or x).
//
// weights holds 12 tensors per layer, in order: attn_norm, mlp_norm, then the qkv,
// o, gate_up and down products' panels and biases (an empty tensor: no bias), then
// the layer's K and V slots. out_features gives the four products' N, once (every
// layer has the same shapes).
#include <torch/extension.h>

#include <vector>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t block_size,
                           bool use_simd);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& bias);

constexpr size_t PER_LAYER = 12;

at::Tensor decoder_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                          const std::vector<at::Tensor>& weights, const std::vector<int64_t>& out_features,
                          int64_t num_heads, int64_t num_kv_heads, double eps, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start, int64_t block_size, bool use_simd) {
  TORCH_CHECK(weights.size() % PER_LAYER == 0, "decoder_layers: 12 tensors per layer");
  TORCH_CHECK(out_features.size() == 4, "decoder_layers: out_features holds the qkv, o, gate_up and down N");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: x must be a contiguous [T, hidden] tensor");
  const int64_t T = x.size(0), H = num_heads, Hkv = num_kv_heads;
  const int64_t n_qkv = out_features[0], n_o = out_features[1], n_gu = out_features[2], n_down = out_features[3];
  TORCH_CHECK(n_qkv % (H + 2 * Hkv) == 0, "decoder_layers: qkv's N must be (heads + 2 KV heads) x head size");
  const int64_t D = n_qkv / (H + 2 * Hkv);
  for (size_t l = 0; l < weights.size(); l += PER_LAYER) {
    const at::Tensor* w = &weights[l];
    const at::Tensor qkv = panel_linear(rms_norm(x, w[0], eps), w[2], n_qkv, w[3]);
    const at::Tensor qk = rope(qkv.narrow(1, 0, (H + Hkv) * D).view({T, H + Hkv, D}), cos, sin);
    const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
    const at::Tensor out = paged_attention(qk.narrow(1, 0, H), qk.narrow(1, H, Hkv), v, w[10], w[11], slot_mapping,
                                           block_tables, seq_lens, query_start, block_size, use_simd);
    x.add_(panel_linear(out.view({T, H * D}), w[4], n_o, w[5]));
    x.add_(panel_linear(silu_and_mul(panel_linear(rms_norm(x, w[1], eps), w[6], n_gu, w[7])), w[8], n_down, w[9]));
  }
  return x;
}
