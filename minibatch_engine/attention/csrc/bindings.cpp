// The Python module of the CPU kernels (built by attention/cpu_kernel.py).
#include <torch/extension.h>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t block_size,
                           bool use_simd);
at::Tensor paged_attention_quantized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start, int64_t block_size);
bool simd_path(at::ScalarType dtype, int64_t head_dim);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& bias);
at::Tensor decoder_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                          const std::vector<at::Tensor>& weights, const std::vector<int64_t>& out_features,
                          int64_t num_heads, int64_t num_kv_heads, double eps, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start, int64_t block_size, bool use_simd);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a ragged batch (paged_attention_cpu.cpp)");
  m.def("paged_attention_quantized", &paged_attention_quantized,
        "paged attention over an fp8/int8 cache, dequantized as read (paged_attention_cpu.cpp)");
  m.def("simd_path", &simd_path, "whether a cache of this dtype and head size takes the SIMD passes");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (cpu_ops.cpp)");
  m.def("rope", &rope, "rotary embedding, half-rotation layout (cpu_ops.cpp)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (cpu_ops.cpp)");
  m.def("pack_panels", &pack_panels, "a linear weight packed into 48-column panels (panel_gemm.cpp)");
  m.def("panel_linear", &panel_linear, "x times a weight packed by pack_panels, plus bias (panel_gemm.cpp)");
  m.def("decoder_layers", &decoder_layers, "a llama step's decoder layers as one loop, x updated in place "
        "(decoder_layers.cpp)");
}
