// A linear layer's product on the CPU over a weight packed once into column panels
// (runner/prepack.py). The layout and the loop are GotoBLAS's and BLIS's: a
// micro-kernel keeps a small block of the output in vector registers while the
// weight streams past.
//
// pack_panels copies a weight W [N, K] (out_features, in_features) into panels of
// NR = 48 output columns: panels[p][k][j] = W[p * NR + j][k], the last panel padded
// with zeros. One panel row (48 floats, three 64-byte vectors) is what the
// micro-kernel multiplies by one input value, so the weight is read front to back,
// a cache line at a time, with no gathers and no re-layout at call time (a GEMM
// library handed a plain weight re-lays it into panels like these on every call;
// at a decode step's few rows that copy costs more than the arithmetic).
//
// panel_linear computes out = x W^T (+ bias) for x [M, K]. For up to MR = 8 rows
// the micro-kernel holds 8 x 3 accumulator vectors (24 of the 32 AVX-512
// registers) and, for each k, loads three weight vectors and broadcasts each row's
// x[m][k]: 24 fused multiply-adds per 11 loads. Threads split the panels (and, for
// many rows, chunks of 64 rows), so each thread reads its own part of the weight.
//
// Every output is one chain of multiply-adds over k = 0 .. K - 1, whatever M is and
// whichever rows share the call: a row's result does not depend on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t W = 16;          // floats in a 64-byte vector
constexpr int64_t NV = 3;          // vectors across a panel
constexpr int64_t NR = W * NV;     // a panel's columns
constexpr int64_t MR = 8;          // rows of a micro-kernel call
constexpr int64_t ROW_CHUNK = 64;  // rows a thread's work item covers

typedef float vec __attribute__((vector_size(64), aligned(4)));   // unaligned loads allowed

// R rows of x times one panel: out[r][0 .. cols) (+ bias), row strides ldx and ldo.
template <int64_t R>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* out,
                         int64_t ldo, int64_t cols) {
  vec acc[R][NV];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NV; ++i) acc[r][i] = vec{};
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += NR) {
    const vec w0 = *reinterpret_cast<const vec*>(w);
    const vec w1 = *reinterpret_cast<const vec*>(w + W);
    const vec w2 = *reinterpret_cast<const vec*>(w + 2 * W);
    for (int64_t r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
      acc[r][2] += xv * w2;
    }
  }
  float tile[NR];
  for (int64_t r = 0; r < R; ++r) {
    if (bias != nullptr)
      for (int64_t i = 0; i < NV; ++i) acc[r][i] += *reinterpret_cast<const vec*>(bias + i * W);
    if (cols == NR) {
      for (int64_t i = 0; i < NV; ++i) *reinterpret_cast<vec*>(out + r * ldo + i * W) = acc[r][i];
    } else {   // the last panel: only its real columns
      std::memcpy(tile, &acc[r][0], sizeof(tile));
      std::memcpy(out + r * ldo, tile, cols * sizeof(float));
    }
  }
}

// the micro-kernel compiled for R rows, for each R of 1 .. MR (the last block of rows)
template <int64_t R>
inline void rows(int64_t n, const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* out,
                 int64_t ldo, int64_t cols) {
  if constexpr (R > 0) {
    if (n == R) return micro_kernel<R>(x, ldx, panel, K, bias, out, ldo, cols);
    rows<R - 1>(n, x, ldx, panel, K, bias, out, ldo, cols);
  }
}

}  // namespace

// W [N, K] float32 -> panels [ceil(N / 48), K, 48], zero-padded.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_panels: the weight must be a 2-D float32 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto panels = at::zeros({P, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(NR, N - p * NR); ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
  return panels;
}

// x [M, K] float32 (rows may be strided, each row contiguous), panels from pack_panels of
// a weight with N output features, bias [N] or an empty tensor -> [M, N].
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "panel_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat && panels.size(2) == NR &&
                  panels.size(1) == x.size(1) && panels.size(0) == (N + NR - 1) / NR,
              "panel_linear: panels must come from pack_panels of an [", N, ", ", x.size(1), "] weight");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.is_contiguous() && bias.numel() == N && bias.scalar_type() == at::kFloat),
              "panel_linear: bias must be [N] float32");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0), ldx = M > 1 ? xc.stride(0) : K;
  auto out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  // a bias padded to whole panels, so the last panel reads no further than its end
  at::Tensor padded;
  const float* bp = nullptr;
  if (has_bias) {
    padded = at::zeros({P * NR}, bias.options());
    padded.narrow(0, 0, N).copy_(bias);
    bp = padded.data_ptr<float>();
  }
  const float* xp = xc.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;   // work items: panel-major (panel, rows)
  at::parallel_for(0, P * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, m_end = std::min(M, (item % chunks + 1) * ROW_CHUNK);
      const int64_t cols = std::min(NR, N - p * NR);
      for (int64_t m0 = (item % chunks) * ROW_CHUNK; m0 < m_end; m0 += MR)
        rows<MR>(std::min(MR, m_end - m0), xp + m0 * ldx, ldx, pp + p * K * NR, K, bp ? bp + p * NR : nullptr,
                 op + m0 * N + p * NR, N, cols);
    }
  });
  return out;
}
