// Fused CPU kernels for the model's small per-token ops (model/fused.py).
//
// In a decode step each of these runs on a few dozen rows of a few hundred
// values: as separate torch ops (pow, mean, add, rsqrt, mul, mul for one
// RMSNorm; neg, cat, mul, mul, add for RoPE) the step pays a dispatch and a pass
// over memory per op. Here each is one pass, parallel over rows. The arithmetic
// is the unfused formula's, up to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.stride(-1) == 1, name, ": CPU tensor with contiguous last dim");
}

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * weight, over the last dim; x: [..., H] (rows may be strided)
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_rows(x_in, "rms_norm");
  const at::Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({-1, x_in.size(-1)});
  const int64_t H = x.size(1), rows = x.size(0), stride = x.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [H] of x's dtype");
  auto out = at::empty({rows, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * stride;
        scalar_t ss = 0;
        for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
        const scalar_t inv = scalar_t(1) / std::sqrt(ss / H + static_cast<scalar_t>(eps));
        scalar_t* o = op + r * H;
        for (int64_t i = 0; i < H; ++i) o[i] = (xr[i] * inv) * wp[i];
      }
    });
  });
  return out.view(x_in.sizes());
}

// Rotary embedding, half-rotation layout: x: [T, heads, D] (token rows may be
// strided, each token's heads contiguous); cos, sin: [T, D]. Returns a new [T, heads, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope");
  TORCH_CHECK(x.dim() == 3 && (x.size(1) == 1 || x.stride(1) == x.size(2)), "rope: x must be [T, heads, D]");
  const int64_t T = x.size(0), Hn = x.size(1), D = x.size(2), half = D / 2, stride = x.stride(0);
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: cos and sin must be contiguous [T, D] of x's dtype, D even");
  auto out = at::empty({T, Hn, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        for (int64_t h = 0; h < Hn; ++h) {
          const scalar_t* xr = xp + t * stride + h * D;
          scalar_t* o = op + (t * Hn + h) * D;
          for (int64_t i = 0; i < half; ++i) o[i] = xr[i] * c[i] - xr[i + half] * s[i];
          for (int64_t i = half; i < D; ++i) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
      }
    });
  });
  return out;
}

// SwiGLU's activation: gate_up: [T, 2I] (gate | up) -> silu(gate) * up: [T, I]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = gp + t * stride;
        const scalar_t* u = g + I;
        scalar_t* o = op + t * I;
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (scalar_t(1) + std::exp(-g[i])) * u[i];
      }
    });
  });
  return out;
}
