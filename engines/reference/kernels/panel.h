// The micro-kernel the hand-written GEMMs share (moe_fused.cpp, panel_linear.cpp): a tile of
// up to kRows rows times 16 output columns, the rows' inputs in a panel [k][kRows] (one cache
// line per step for all the rows) and the weights a contiguous [k][16] stream read once for
// the tile. Each output is a sequential sum over k, so a row's result does not depend on which
// rows share its tile or on the thread count.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace tokenmill {

// Sixteen floats: one AVX-512 register, two AVX2 registers (four SSE where the CPU has no
// AVX); GCC's vector extension, so one source serves every x86 and Arm build.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// Rows per micro-kernel call, one 16-column accumulator each: with AVX-512's 32 registers,
// 16 rows plus the weights and a broadcast; with AVX2's 16, 6 rows of two registers each.
#if defined(__AVX512F__)
constexpr int kRows = 16;
#else
constexpr int kRows = 6;
#endif

// Floats ahead of the weight reads to prefetch (one 64-byte line per k step).
#ifndef PF_DIST
#define PF_DIST 512
#endif
constexpr int64_t kPrefetch = PF_DIST;

// acc[r] = sum over k of panel[k][r] * w[k][0..15] for a tile's R rows (`panel` [n][kRows]),
// streaming `w` ([n][16], contiguous) once.
template <int R>
inline void tile_products(const float* panel, const float* w, int64_t n, v16 (&acc)[R]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = v16{};
  for (int64_t k = 0; k < n; ++k) {
    __builtin_prefetch(w + 16 * k + kPrefetch, 0, 0);
    const v16 wk = load16(w + 16 * k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] += panel[k * kRows + r] * wk;
  }
}

// A table of Tile<R>::fn for R = 1 .. kRows, indexed by R - 1 (the row count of a tile is
// known at run time; each R gets its own unrolled code).
template <typename Fn, template <int> class Tile, int... R>
constexpr std::array<Fn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {Tile<R + 1>::fn...};
}

// A tile's rows into its panel [k_len][kRows]: row(r) points at row r's k_len inputs.
template <typename Row>
inline void fill_panel(Row&& row, int64_t rows, int64_t k_len, float* panel) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = row(r);
    for (int64_t k = 0; k < k_len; ++k) panel[k * kRows + r] = x[k];
  }
}

}  // namespace tokenmill
