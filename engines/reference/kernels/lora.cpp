// LoRA terms of a step's rows, each row with its own adapter (CPU): for every row t whose
// slot s = slots[t] is not -1,
//
//     y[t] += B[s][:, :k] (A[s][:k] x[t]),   k = widths[s]
//
// with A [slots, W, in] and B [slots, out, W] holding each slot's adapter (zero past its
// width; engines/reference/model/lora.py lays them out, the scale folded into B).
//
// Why a kernel: in torch ops a step with rows of G adapters costs 4 small ops per adapter per
// projection (gather the rows, two matmuls, scatter-add back); on 2 cores at the engine's
// shapes those tiny GEMMs and dispatches cost as much as the base projection itself
// (tests/benchmarks/bench_lora.py). Here each row is two short passes: k dot products of
// length `in` (the shrink, accumulated in fp32), then `out` dot products of length k (the
// expand, added into y in place). Rows are split over the intra-op threads when a step has
// enough work; a slot's A and B are re-read from cache by its rows, as punica's grouped
// kernels do on GPUs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Multiply-adds per thread chunk: a decode step of a few rows stays on the calling thread.
constexpr int64_t kParallelWork = 1 << 18;

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& slots, const at::Tensor& widths) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_add: x [T, in], y [T, out], a [S, W, in], b [S, out, W]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "lora_add: contiguous tensors");
  const int64_t tokens = x.size(0), fan_in = x.size(1), fan_out = y.size(1);
  const int64_t num_slots = a.size(0), width = a.size(1);
  TORCH_CHECK(y.size(0) == tokens && a.size(2) == fan_in && b.size(0) == num_slots &&
                  b.size(1) == fan_out && b.size(2) == width,
              "lora_add: shapes do not agree");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "lora_add: one dtype throughout");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens,
              "lora_add: slots int64 [T]");
  TORCH_CHECK(widths.scalar_type() == at::kLong && widths.numel() == num_slots,
              "lora_add: widths int64 [S]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* wp = widths.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_slots; ++s)
    TORCH_CHECK(wp[s] >= 0 && wp[s] <= width, "lora_add: width of slot ", s, " out of range");
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "lora_add: slot of row ", t, " out of range");
  const int64_t per_row = std::max<int64_t>(1, width * (fan_in + fan_out));
  const int64_t grain = std::max<int64_t>(1, kParallelWork / per_row);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_add", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> h(width);
      std::vector<float> xf(fan_in);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t s = sp[t];
        if (s < 0) continue;
        const int64_t k = wp[s];
        if (k == 0) continue;
        const scalar_t* xr = xp + t * fan_in;
        for (int64_t i = 0; i < fan_in; ++i) xf[i] = f32(xr[i]);
        const scalar_t* as = ap + s * width * fan_in;
        for (int64_t j = 0; j < k; ++j) {  // shrink: h = A x
          const scalar_t* aj = as + j * fan_in;
          float acc = 0.f;
          for (int64_t i = 0; i < fan_in; ++i) acc += f32(aj[i]) * xf[i];
          h[j] = acc;
        }
        const scalar_t* bs = bp + s * fan_out * width;
        scalar_t* yr = yp + t * fan_out;
        for (int64_t o = 0; o < fan_out; ++o) {  // expand: y += B h
          const scalar_t* bo = bs + o * width;
          float acc = 0.f;
          for (int64_t j = 0; j < k; ++j) acc += f32(bo[j]) * h[j];
          yr[o] = static_cast<scalar_t>(f32(yr[o]) + acc);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, Tensor widths) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("lora_add", &lora_add); }
