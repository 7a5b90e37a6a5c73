// Element-wise steps of the decoder fused into one pass each over a step's rows (CPU): RMSNorm
// (optionally with the residual add before it), rotary embedding (alone, or with the K/V cache
// write), and SiLU(gate) * up.
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
#include <optional>
#include <vector>

namespace {

// Elements per thread chunk. A pass over fewer stays on the calling thread: handing it to the
// OpenMP workers costs about what splitting a decode step's pass saves (chunks of 4K elements
// measured no faster on the bench workload).
constexpr int64_t kParallelElements = 1 << 16;

inline int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements));
}

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// RMSNorm of one row of n into o (o may be x): fp32 statistics, then weight * (x * inv) with
// the product x * inv rounded to the model dtype first, as transformers does.
template <typename scalar_t>
inline void rms_row(const scalar_t* x, const scalar_t* w, scalar_t* o, int64_t n, float eps) {
  float sq = 0.f;
  for (int64_t i = 0; i < n; ++i) sq += f32(x[i]) * f32(x[i]);
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    o[i] = static_cast<scalar_t>(f32(w[i]) * f32(static_cast<scalar_t>(f32(x[i]) * inv)));
}

// RMSNorm of each row of x into out; with `delta`, x += delta first (in place, the sum rounded
// to the model dtype before the norm reads it, as x + delta, then the norm, does).
template <typename scalar_t>
void rms_rows(scalar_t* x, const scalar_t* delta, const scalar_t* w, scalar_t* out, int64_t rows,
              int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x + r * x_stride;
      if (delta != nullptr) {
        const scalar_t* dr = delta + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = static_cast<scalar_t>(f32(xr[i]) + f32(dr[i]));
      }
      rms_row(xr, w, out + r * n, n, eps);
    }
  });
}

// RMSNorm of `rows` contiguous rows of n in place (Qwen3's q/k head norms inside rope_cache).
template <typename scalar_t>
void rms_head_rows(scalar_t* x, const scalar_t* w, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) rms_row(x + r * n, w, x + r * n, n, eps);
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
    rms_rows<scalar_t>(rows.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), rows.size(0), n, rows.stride(0),
                       static_cast<float>(eps));
  });
  return out.view(x.sizes());
}

// x += delta (the residual stream, in place), then RMSNorm of the sum, one pass per row.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.is_contiguous(),
              "add_rms_norm: contiguous [T, hidden]");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x and delta differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                       weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, n,
                       static_cast<float>(eps));
  });
  return out;
}

// One row's rotary embedding of `heads` heads: o = x * cos + rotate_half(x) * sin, each product
// rounded to the model dtype before the sum, as torch's ops do.
template <typename scalar_t>
inline void rope_heads(const scalar_t* x, int64_t head_stride, const scalar_t* c,
                       const scalar_t* s, int64_t heads, int64_t dim, scalar_t* o,
                       int64_t out_head_stride) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* xi = x + h * head_stride;
    scalar_t* oh = o + h * out_head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const scalar_t a = static_cast<scalar_t>(f32(xi[i]) * f32(c[i]));
      const scalar_t b = static_cast<scalar_t>(-f32(xi[i + half]) * f32(s[i]));
      oh[i] = static_cast<scalar_t>(f32(a) + f32(b));
    }
    for (int64_t i = half; i < dim; ++i) {
      const scalar_t a = static_cast<scalar_t>(f32(xi[i]) * f32(c[i]));
      const scalar_t b = static_cast<scalar_t>(f32(xi[i - half]) * f32(s[i]));
      oh[i] = static_cast<scalar_t>(f32(a) + f32(b));
    }
  }
}

// Rotary embedding, out of place: out = x * cos + rotate_half(x) * sin, x [T, H, D] with the
// last dim contiguous (a q or k slice of the fused qkv output), cos / sin [T, 1, D] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope: x [T, H, D], last dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2),
              "rope: cos / sin [T, 1, D] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type(), "rope: dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  auto out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * dim;
        const scalar_t* s = sp + t * dim;
        rope_heads(xp + t * st, sh, c, s, heads, dim, op + t * heads * dim, dim);
      }
    });
  });
  return out;
}

// The attention inputs of a step from the fused projection, in one pass over its rows:
// qkv [T, (H + 2 KVH) * D] -> returns q with RoPE [T, H, D]; K with RoPE and V are written to
// their cache slots (k_cache / v_cache [KVH, NB, BS, D], slot = block * BS + offset). Replaces
// two rope passes, two index_copy passes and the transposes between them; with q_norm / k_norm
// (Qwen3), also the two per-head RMSNorm passes before RoPE.
at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                      int64_t heads, const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_cache: qkv [T, (H + 2 KVH) * D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "rope_cache: caches [KVH, NB, BS, D], contiguous");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() &&
                  qkv.scalar_type() == v_cache.scalar_type() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_cache: dtypes differ");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(0), dim = k_cache.size(3);
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "rope_cache: qkv width");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * dim &&
                  sin.numel() == tokens * dim,
              "rope_cache: cos / sin [T, 1, D] contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "rope_cache: slots [T] int64");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "rope_cache: both head norms or neither");
  if (q_norm.has_value())
    TORCH_CHECK(q_norm->is_contiguous() && k_norm->is_contiguous() && q_norm->numel() == dim &&
                    k_norm->numel() == dim && q_norm->scalar_type() == qkv.scalar_type() &&
                    k_norm->scalar_type() == qkv.scalar_type(),
                "rope_cache: q_norm / k_norm [D] in the model dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // a bookkeeping bug fails here, not outside the cache
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache_slots, "rope_cache: slot ", sp[t], " of token ", t,
                " outside the cache (", cache_slots, " slots)");
  auto q = at::empty({tokens, heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_cache", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* snp = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t width = qkv.size(1), head_stride = cache_slots * dim;
    const scalar_t* qn = q_norm.has_value() ? q_norm->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kn = k_norm.has_value() ? k_norm->data_ptr<scalar_t>() : nullptr;
    const float epsf = static_cast<float>(eps);
    at::parallel_for(0, tokens, row_grain(width), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> normed(qn != nullptr ? (heads + kv_heads) * dim : 0);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xp + t * width;
        if (qn != nullptr) {  // Qwen3: each q and k head RMSNorm-ed before RoPE
          std::memcpy(normed.data(), row, normed.size() * sizeof(scalar_t));
          rms_head_rows(normed.data(), qn, heads, dim, epsf);
          rms_head_rows(normed.data() + heads * dim, kn, kv_heads, dim, epsf);
          row = normed.data();  // V is read from the projection below, not from here
        }
        const scalar_t* c = cp + t * dim;
        const scalar_t* s = snp + t * dim;
        rope_heads(row, dim, c, s, heads, dim, qp + t * heads * dim, dim);
        scalar_t* k_slot = kc + sp[t] * dim;
        rope_heads(row + heads * dim, dim, c, s, kv_heads, dim, k_slot, head_stride);
        const scalar_t* v = xp + t * width + (heads + kv_heads) * dim;
        for (int64_t h = 0; h < kv_heads; ++h)
          std::memcpy(vc + h * head_stride + sp[t] * dim, v + h * dim, dim * sizeof(scalar_t));
      }
    });
  });
  return q;
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
    at::parallel_for(0, tokens, row_grain(3 * inter), [&](int64_t begin, int64_t end) {
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
  m.def(
      "rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, int heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_cache", &rope_cache);
}
