// Element-wise steps of the decoder fused into one pass each over a step's rows (CPU): RMSNorm
// (optionally with the residual add before it), rotary embedding, and SiLU(gate) * up.
//
// In torch each of these is 3-8 separate ops, each a pass over the [T, hidden] activations and
// a dispatch on the step thread; at the engine's sizes those passes cost about as much as the
// attention. Statistics are in fp32 as transformers computes them; rows are split over the
// intra-op threads when a step has enough of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRowGrain = 32;  // rows per thread chunk; fewer rows stay on this thread

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void rms_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows, int64_t n,
              int64_t x_stride, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* o = out + r * n;
      float sq = 0.f;
      for (int64_t i = 0; i < n; ++i) sq += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
      // weight * (x * inv) rounded to the model dtype first, as transformers does.
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<scalar_t>(f32(w[i]) * f32(static_cast<scalar_t>(f32(xr[i]) * inv)));
    }
  });
}

// RMSNorm over the last dimension of x ([..., n], rows may be strided, the last dim not).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.stride(-1) == 1, "rms_norm: CPU, last dim contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "rms_norm: weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype");
  const int64_t n = x.size(-1);
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, n});
  auto out = at::empty({rows.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(rows.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), rows.size(0), n, rows.stride(0),
                       static_cast<float>(eps));
  });
  return out.view(x.sizes());
}

// x += delta (the residual stream, in place), then RMSNorm of the sum.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.is_contiguous(),
              "add_rms_norm: contiguous [T, hidden]");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x and delta differ");
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kRowGrain * n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) xp[i] = static_cast<scalar_t>(f32(xp[i]) + f32(dp[i]));
    });
  });
  return rms_norm(x, weight, eps);
}

// Rotary embedding, out of place: out = x * cos + rotate_half(x) * sin, x [T, H, D] with the
// last dim contiguous (a q or k slice of the fused qkv output), cos / sin [T, 1, D] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope: x [T, H, D], last dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2),
              "rope: cos / sin [T, 1, D] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type(), "rope: dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  auto out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * dim;
        const scalar_t* s = sp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* xi = xp + t * st + h * sh;
          scalar_t* o = op + (t * heads + h) * dim;
          // Each product rounded to the model dtype before the sum, as torch's ops do.
          for (int64_t i = 0; i < half; ++i) {
            const scalar_t a = static_cast<scalar_t>(f32(xi[i]) * f32(c[i]));
            const scalar_t b = static_cast<scalar_t>(-f32(xi[i + half]) * f32(s[i]));
            o[i] = static_cast<scalar_t>(f32(a) + f32(b));
          }
          for (int64_t i = half; i < dim; ++i) {
            const scalar_t a = static_cast<scalar_t>(f32(xi[i]) * f32(c[i]));
            const scalar_t b = static_cast<scalar_t>(f32(xi[i - half]) * f32(s[i]));
            o[i] = static_cast<scalar_t>(f32(a) + f32(b));
          }
        }
      }
    });
  });
  return out;
}

// SiLU(gate) * up for gate_up = [gate | up] along the last dim ([T, 2I] -> [T, I]).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: contiguous [T, 2I]");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = gp + t * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = op + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float gi = f32(g[i]);
          const scalar_t act = static_cast<scalar_t>(gi / (1.f + tokenmill::fast_exp(-gi)));
          o[i] = static_cast<scalar_t>(f32(act) * f32(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
}
