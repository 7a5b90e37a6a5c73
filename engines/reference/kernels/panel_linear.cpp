// y = x W^T (+ bias) (+ residual) for fp32 linears, W laid out once at load in the order the
// shared micro-kernel (panel.h) streams it: [ceil(N / 16), K, 16], 16 output columns a block.
//
// Why by hand: oneDNN's inner product reaches its peak on hundreds of rows, but a decode step
// has tens, and there it ran the `small` models' projections and LM head at 90-140 GFLOP/s of
// the 2-core machine's ~220. Here each 16-column block of W is read once for all the step's
// rows (16 rows a pass, their inputs in panels), and a row's result is the same sequential sum
// over K whatever else is in the step or however many threads run it.
//
// Work is split over the threads by column blocks. Rows go in groups whose panels stay in the
// core's L2 (kGroupBytes), the group's panels read once per column block; W's blocks are
// re-read once per group, from the L3 or memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "panel.h"

namespace {

using tokenmill::kRows;
using tokenmill::v16;

constexpr int64_t kGroupBytes = 512 * 1024;  // panels of a row group: half a Zen 4 L2
constexpr int64_t kSerialWork = 1 << 20;  // multiply-adds below which one thread does it all

struct Epilogue {
  const float* bias;      // [N] or nullptr
  const float* residual;  // [T, N] or nullptr
  float* y;               // [T, N]
  int64_t n;
};

// One tile of R rows (row0 .. row0 + R - 1) by 16 columns (block j): the products, then
// bias and residual added and the `cols` columns that exist stored.
template <int R>
void linear_tile(const float* panel, const float* w, int64_t k_len, const Epilogue& e,
                 int64_t row0, int64_t j) {
  v16 acc[R];
  tokenmill::tile_products<R>(panel, w, k_len, acc);
  const int64_t c0 = 16 * j;
  const int cols = static_cast<int>(std::min<int64_t>(16, e.n - c0));
  for (int r = 0; r < R; ++r) {
    float out[16];
    tokenmill::store16(out, acc[r]);
    float* y = e.y + (row0 + r) * e.n + c0;
    const float* res = e.residual != nullptr ? e.residual + (row0 + r) * e.n + c0 : nullptr;
    for (int c = 0; c < cols; ++c) {
      float v = out[c];
      if (e.bias != nullptr) v += e.bias[c0 + c];
      if (res != nullptr) v += res[c];
      y[c] = v;
    }
  }
}

template <int R>
struct LinearTile {
  static constexpr auto fn = &linear_tile<R>;
};
using TileFn = void (*)(const float*, const float*, int64_t, const Epilogue&, int64_t, int64_t);
constexpr auto kTiles =
    tokenmill::tiles<TileFn, LinearTile>(std::make_integer_sequence<int, kRows>());

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, int64_t n,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "panel_linear: fp32 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "panel_linear: contiguous x [T, K]");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) == 16 && w.size(1) == x.size(1),
              "panel_linear: packed weight [N / 16, K, 16] with K = x's columns");
  TORCH_CHECK(n > 16 * (w.size(0) - 1) && n <= 16 * w.size(0),
              "panel_linear: ", n, " outputs do not fit the packed weight's ", w.size(0),
              " blocks of 16");
  const int64_t rows = x.size(0), k_len = x.size(1), blocks = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n,
                "panel_linear: bias must be fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  const float* rp = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                    residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == n,
                "panel_linear: residual must be fp32 [T, N]");
    rp = residual->data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const Epilogue e{bp, rp, y.data_ptr<float>(), n};
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();

  const int64_t tiles = (rows + kRows - 1) / kRows;
  const auto tile_rows = [&](int64_t t) { return std::min<int64_t>(kRows, rows - t * kRows); };
  const std::unique_ptr<float[]> panels(new float[tiles * k_len * kRows]);
  const bool serial = rows * k_len * n < kSerialWork;
  at::parallel_for(0, tiles, serial ? tiles : 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tokenmill::fill_panel([&](int64_t r) { return xp + (t * kRows + r) * k_len; },
                            tile_rows(t), k_len, panels.get() + t * k_len * kRows);
  });
  const int64_t group =
      std::max<int64_t>(1, kGroupBytes / (k_len * kRows * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, blocks, serial ? blocks : 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = 0; g < tiles; g += group)
      for (int64_t j = begin; j < end; ++j)
        for (int64_t t = g; t < std::min(tiles, g + group); ++t)
          kTiles[tile_rows(t) - 1](panels.get() + t * k_len * kRows, wp + j * k_len * 16, k_len,
                                   e, t * kRows, j);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "panel_linear(Tensor x, Tensor w, int n, Tensor? bias=None, Tensor? residual=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("panel_linear", &panel_linear); }
