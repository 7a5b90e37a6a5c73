// Attention of every query row of a step (decode tokens, speculative verifications, prefill
// chunks) over the paged KV cache, read in place: no gathered copy of any request's context.
//
// For every query row r (a token of the step's flat batch) and KV head h, the G query heads
// sharing h are scored against keys 0 .. limit[r] - 1 of the row's request, key j living in
// block table[req[r]][j / block_size] at offset j % block_size of the cache. Scores and the
// softmax are kept in fp32. In fp32 with the common head sizes, each K and V row is read once
// for all G heads (attend_row_vec), and once for a tile of a chunk's rows (attend_tile);
// other dtypes and shapes take a plain loop per head (attend_row), whose re-reads come from
// the core's cache. Work is split over (row, KV head)
// pairs in runs of equal key counts, one per thread; a step with fewer pairs than `grain` runs
// on the calling thread (waking OpenMP workers costs more than a small step's work).
//
// Two optional parts of GPT-OSS's attention (transformers' eager GptOssAttention), so that its
// layers take this kernel too instead of a masked SDPA over a gathered copy:
// - sinks: a logit per query head that joins each row's softmax (its max and its sum) and
//   attends to nothing, so its share of the probability is dropped. A sink of -inf is no sink.
// - window: a row at position p = limit[r] - 1 attends only to keys p - window + 1 .. p, i.e.
//   (p - window, p], as transformers' sliding-window mask (kv_idx > q_idx - window); keys
//   before the window are not read at all. 0: no window.
//
// Why one kernel for prefill too: a prefill chunk's rows re-read their request's context from
// L2, and even scoring one row at a time beat torch's flash-attention SDPA (which runs its
// small GEMMs through MKL's AVX2 code on AMD) by 2.4x on 4 x 500-token prompts, and it needs
// no gathered copy of a chunk's cached history. In fp32, rows with company from their own
// request now go in tiles (attend_tile), 1.6x faster again.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// What a call attends with besides the causal keys (see the file comment).
struct SinkWindow {
  const float* sinks;  // [H] fp32 sink logit of each query head; nullptr: no sinks
  int64_t window;      // keys a row sees at most, counting back from its own; 0: no window
};

// The keys one row attends to: `count` of them from key `first` (its window's start).
struct KeySpan {
  int64_t first;
  int64_t count;
};

inline KeySpan row_keys(int64_t limit, int64_t window) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, limit - window) : 0;
  return {first, limit - first};
}

// Softmax of one head's `keys` scores in place, max-subtracted; returns 1 / the sum. A sink
// (nullptr: none) is one more logit in the max and the sum whose own probability is dropped;
// std::exp of a -inf sink is exactly 0 (fast_exp clamps), so such a sink changes nothing.
inline float softmax_in_place(float* __restrict s, int64_t keys, const float* sink) {
  float top = s[0];
  for (int64_t j = 1; j < keys; ++j) top = std::max(top, s[j]);  // the loops vectorise
  if (sink != nullptr) top = std::max(top, *sink);
  float total = 0.f;
  for (int64_t j = 0; j < keys; ++j) {
    s[j] = tokenmill::fast_exp(s[j] - top);
    total += s[j];
  }
  if (sink != nullptr) total += std::exp(*sink - top);
  return 1.f / total;
}

// One (query row, KV head): the G heads' scores over the row's keys `span`, softmax (with the
// heads' sinks, nullptr: none), then the weighted sum of V. D is a compile-time constant for
// the common head sizes, so a head's query and its output accumulator stay in registers;
// heads are taken one at a time so they do (the row's K and V, re-read per head, come from
// the core's L2).
template <typename scalar_t, int D>
inline void attend_row(
    const scalar_t* __restrict q_row, const scalar_t* __restrict k_head,
    const scalar_t* __restrict v_head, const int32_t* __restrict table, KeySpan span,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t dim, float scale,
    const float* sinks, float* __restrict scores, scalar_t* __restrict o_row) {
  const int64_t d_len = D > 0 ? D : dim;
  const int64_t keys = span.count;
  const int64_t end = span.first + keys;
  for (int64_t g = 0; g < group; ++g) {
    float qg[D > 0 ? D : 1];
    std::vector<float> q_dyn(D > 0 ? 0 : d_len);
    float* qv = D > 0 ? qg : q_dyn.data();
    for (int64_t d = 0; d < d_len; ++d) qv[d] = to_float(q_row[g * d_len + d]) * scale;
    float* s = scores + g * keys;  // s[i]: key first + i
    for (int64_t j = span.first; j < end;) {  // block by block: no division per key
      const int64_t off = j % block_size;
      const int64_t n = std::min(block_size - off, end - j);
      const scalar_t* kb = k_head + table[j / block_size] * block_stride + off * d_len;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* kr = kb + t * d_len;
        float dot = 0.f;
        for (int64_t d = 0; d < d_len; ++d) dot += qv[d] * to_float(kr[d]);
        s[j - span.first + t] = dot;
      }
      j += n;
    }
    const float inv = softmax_in_place(s, keys, sinks != nullptr ? sinks + g : nullptr);
    float acc[D > 0 ? D : 1];
    std::vector<float> acc_dyn(D > 0 ? 0 : d_len);
    float* av = D > 0 ? acc : acc_dyn.data();
    for (int64_t d = 0; d < d_len; ++d) av[d] = 0.f;
    for (int64_t j = span.first; j < end;) {
      const int64_t off = j % block_size;
      const int64_t n = std::min(block_size - off, end - j);
      const scalar_t* vb = v_head + table[j / block_size] * block_stride + off * d_len;
      for (int64_t t = 0; t < n; ++t) {
        const float p = s[j - span.first + t];
        const scalar_t* vr = vb + t * d_len;
        for (int64_t d = 0; d < d_len; ++d) av[d] += p * to_float(vr[d]);
      }
      j += n;
    }
    for (int64_t d = 0; d < d_len; ++d) o_row[g * d_len + d] = static_cast<scalar_t>(av[d] * inv);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
// fp32 with the head size a multiple of 16 (64 and 128 are unrolled) and up to 8 query heads
// per KV head: GCC vector types of 16 floats (one AVX-512 register; two AVX2 ones, or NEON
// quads, where the machine has those), and each K and V row of the context read once for all
// G heads of the KV head instead of once per head.
#define TOKENMILL_VECTOR_ATTENTION 1
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// A 16 x 16 block (row i in r[i]) transposed in place: at each level, rows i and i + S swap
// their off-diagonal S x S sub-blocks (64 two-register shuffles in all).
inline void transpose16(vf16* r) {
#define TOKENMILL_LEVEL(S, ...)                                              \
  for (int base = 0; base < 16; base += 2 * S)                               \
    for (int i = base; i < base + S; ++i) {                                  \
      const vf16 a = r[i], b = r[i + S];                                     \
      r[i] = __builtin_shufflevector(a, b, __VA_ARGS__);                     \
      r[i + S] = __builtin_shufflevector(a, b, TOKENMILL_HI_##S);            \
    }
#define TOKENMILL_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define TOKENMILL_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define TOKENMILL_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define TOKENMILL_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
  TOKENMILL_LEVEL(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
  TOKENMILL_LEVEL(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
  TOKENMILL_LEVEL(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
  TOKENMILL_LEVEL(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
#undef TOKENMILL_LEVEL
#undef TOKENMILL_HI_8
#undef TOKENMILL_HI_4
#undef TOKENMILL_HI_2
#undef TOKENMILL_HI_1
}

// tokenmill::fast_exp on 16 lanes (the same arithmetic lane by lane, so the same results).
inline vf16 fast_exp16(vf16 x) {
  const vf16 lo = vf16{} - 87.f, hi = vf16{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf16 t = x * 1.44269504088896341f;
  vf16 n;
  for (int i = 0; i < 16; ++i) n[i] = std::nearbyint(t[i]);
  const vf16 p = tokenmill::exp_reduced((t - n) * 0.693147180559945309f);
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16u*>(p); }
inline void store16(float* p, vf16 v) { *reinterpret_cast<vf16u*>(p) = v; }

inline float hsum16(vf16 v) {
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}

// The lane sums of four vectors at once (lanes 0, 4, 8 and 12 of the result): a shuffle tree
// shared by the four, a third of the work of four separate reductions.
inline vf16 hsum4(vf16 a, vf16 b, vf16 c, vf16 d) {
  vf16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                    30, 31);
  vf16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                    30, 31);
  vf16 u = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  u += __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  u += __builtin_shufflevector(u, u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return u;
}

// Calls visit(row, i) for the keys j = span.first + i of one KV head's paged context (`head`
// points at the head's pool, row at key j's D values), block by block: no division per key.
// Blocks lie anywhere in the pool, so the next block is prefetched while this one is visited
// (one line per 16 floats; it doubled decode's speed, where every block comes from memory).
template <int D, typename Visit>
inline void for_each_key(const float* __restrict head, const int32_t* __restrict table,
                         KeySpan span, int64_t block_size, int64_t block_stride, Visit&& visit) {
  const int64_t end = span.first + span.count;
  for (int64_t j = span.first; j < end;) {
    const int64_t off = j % block_size;
    const int64_t n = std::min(block_size - off, end - j);
    const float* block = head + table[j / block_size] * block_stride + off * D;
    const float* next = j + n < end ? head + table[(j + n) / block_size] * block_stride : block;
    for (int64_t t = 0; t < n; ++t) {
      for (int v = 0; v < D / 16; ++v) __builtin_prefetch(next + t * D + v * 16, 0, 3);
      visit(block + t * D, j - span.first + t);
    }
    j += n;
  }
}

// Softmax of each of G heads' scores (head g's at scores + g * stride, `keys` of them) in place,
// with head g's sink (sinks[g]; nullptr: none); inv[g] gets 1 / the head's sum.
template <int G>
inline void softmax_heads(float* __restrict scores, int64_t stride, int64_t keys,
                          const float* sinks, float* __restrict inv) {
  for (int g = 0; g < G; ++g)
    inv[g] = softmax_in_place(scores + g * stride, keys, sinks != nullptr ? sinks + g : nullptr);
}

// o_row[g] = sum_j p[g][j] V[j] * inv[g] for the G heads: one pass over the row's V (paged).
template <int D, int G>
inline void weighted_values(const float* __restrict scores, int64_t stride,
                            const float* __restrict v_head, const int32_t* __restrict table,
                            KeySpan span, int64_t block_size, int64_t block_stride,
                            const float* __restrict inv, float* __restrict o_row) {
  constexpr int V = D / 16;
  vf16 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = vf16{};
  for_each_key<D>(v_head, table, span, block_size, block_stride, [&](const float* vr, int64_t i) {
    vf16 val[V];
    for (int v = 0; v < V; ++v) val[v] = load16(vr + v * 16);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * stride + i];
      for (int v = 0; v < V; ++v) acc[g][v] += p * val[v];
    }
  });
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) store16(o_row + g * D + v * 16, acc[g][v] * inv[g]);
}

// One (query row, KV head) in fp32: scores of the G heads against each key of `span` (one K
// read, dot products), the softmax per head (with its sink, if any), then one pass over V for
// all G outputs. `scores` holds G * span.count. The shape of decode: a row of its own over a
// context nobody else in the step reads.
template <int D, int G>
void attend_row_vec(const float* __restrict q_row, const float* __restrict k_head,
                    const float* __restrict v_head, const int32_t* __restrict table, KeySpan span,
                    int64_t block_size, int64_t block_stride, float scale, const float* sinks,
                    float* __restrict scores, float* __restrict o_row) {
  constexpr int V = D / 16;
  const int64_t keys = span.count;
  vf16 q[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) q[g][v] = load16(q_row + g * D + v * 16) * scale;

  for_each_key<D>(k_head, table, span, block_size, block_stride, [&](const float* kr, int64_t j) {
    vf16 k[V];
    for (int v = 0; v < V; ++v) k[v] = load16(kr + v * 16);
    int g = 0;
    for (; g + 4 <= G; g += 4) {
      vf16 acc[4];
      for (int i = 0; i < 4; ++i) {
        acc[i] = q[g + i][0] * k[0];
        for (int v = 1; v < V; ++v) acc[i] += q[g + i][v] * k[v];
      }
      const vf16 s = hsum4(acc[0], acc[1], acc[2], acc[3]);
      for (int i = 0; i < 4; ++i) scores[(g + i) * keys + j] = s[4 * i];
    }
    for (; g < G; ++g) {
      vf16 acc = q[g][0] * k[0];
      for (int v = 1; v < V; ++v) acc += q[g][v] * k[v];
      scores[g * keys + j] = hsum16(acc);
    }
  });
  float inv[G];
  softmax_heads<G>(scores, keys, keys, sinks, inv);
  weighted_values<D, G>(scores, keys, v_head, table, span, block_size, block_stride, inv, o_row);
}

// The rows of a request's prefill chunk (or verification) in tiles of up to 16 / G rows: the
// tile's L = rows x G queries (L <= 16) ride in the lanes of one vector, so each K and V row
// is read once per tile and every product is a full-width FMA with a broadcast operand.
// Scoring a lone row (attend_row_vec) spends about as many shuffles summing each dot
// product's lanes as multiplies; here there are none (the queries are transposed once per
// tile instead): one layer of a 2,161-row prefill step of 8 prompts (8 heads over 2 KV heads,
// D = 64) took 4.6 ms instead of 7.5 on 2 threads. Each query's dot products, softmax and
// weighted sum run in the same order whichever queries share its tile, so a row's output does
// not depend on how a step is chunked or split over the threads (tested bit for bit).
#ifdef __AVX512F__
constexpr int kTileKeys = 16;  // keys scored per pass: 16 accumulators + the query vector
constexpr int kTileLanes = 16;  // queries per pass of the weighted sum
#else
constexpr int kTileKeys = 4;  // a vf16 is two AVX2 registers (16 of them): fewer at a time
constexpr int kTileLanes = 8;
#endif

// Attention of `n` rows of one request (rows[0 .. n - 1], key limits limit[0 .. n - 1]) for
// KV head h's G query heads; lane i is row i / G, head h * G + i % G. `work` is scratch.
template <int D, int G>
void attend_tile(const float* __restrict q, int64_t q_row_stride, const int64_t* rows,
                 const int32_t* limit, int64_t n, int64_t h, const float* __restrict k_head,
                 const float* __restrict v_head, const int32_t* __restrict table,
                 int64_t block_size, int64_t block_stride, float scale,
                 const float* sinks, int64_t window, std::vector<float>& work,
                 std::vector<int64_t>& offsets, float* __restrict out) {
  static_assert(G >= 1 && G <= 8, "a tile holds at least two rows of G queries");
  const int lanes = static_cast<int>(n) * G;
  // Each lane's keys [first, end); lanes past `lanes` copy lane 0 (their results are dropped).
  int64_t first[16], end[16];
  int64_t lo = INT64_MAX, hi = 0;
  for (int i = 0; i < 16; ++i) {
    const KeySpan span = row_keys(limit[i < lanes ? i / G : 0], window);
    first[i] = span.first;
    end[i] = span.first + span.count;
    lo = std::min(lo, first[i]);
    hi = std::max(hi, end[i]);
  }
  const int64_t keys = hi - lo;
  const int64_t padded = (keys + kTileKeys - 1) / kTileKeys * kTileKeys;
  // Where each key's K (and V) row starts in its head's pool; padding repeats the first key.
  offsets.resize(padded);
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = lo + j;
    offsets[j] = table[key / block_size] * block_stride + (key % block_size) * D;
  }
  for (int64_t j = keys; j < padded; ++j) offsets[j] = offsets[0];
  // work: the queries transposed ([D][16], scaled), then the scores [padded][16].
  work.resize(16 * D + padded * 16 + kTileKeys * D + 16);
  float* qt = work.data() + (16 - reinterpret_cast<uintptr_t>(work.data()) / 4 % 16) % 16;
  float* scores = qt + 16 * D;
  const float* qi[16];
  for (int i = 0; i < 16; ++i) {
    const int lane = i < lanes ? i : 0;
    qi[i] = q + rows[lane / G] * q_row_stride + (h * G + lane % G) * D;
  }
  for (int c = 0; c < D / 16; ++c) {
    vf16 block[16];
    for (int i = 0; i < 16; ++i) block[i] = load16(qi[i] + c * 16) * scale;
    transpose16(block);
    for (int d = 0; d < 16; ++d) *reinterpret_cast<vf16*>(qt + (c * 16 + d) * 16) = block[d];
  }
  // Scores: s[j][i] = q_i . k_j, kTileKeys keys at a time, D FMAs each, the keys' rows at
  // fixed distances from one pointer (16 pointers would not fit in registers): in place where
  // they are consecutive in one block, else copied next to each other first.
  float* gathered = scores + padded * 16;
  for (int64_t j0 = 0; j0 < padded; j0 += kTileKeys) {
    const float* kr = k_head + offsets[j0];
    if (offsets[j0 + kTileKeys - 1] - offsets[j0] != (kTileKeys - 1) * D) {
      for (int t = 0; t < kTileKeys; ++t)
        std::memcpy(gathered + t * D, k_head + offsets[j0 + t], D * sizeof(float));
      kr = gathered;
    }
    vf16 acc[kTileKeys];
    for (int t = 0; t < kTileKeys; ++t) acc[t] = vf16{};
    for (int d = 0; d < D; ++d) {
      const vf16 qd = *reinterpret_cast<const vf16*>(qt + d * 16);
      for (int t = 0; t < kTileKeys; ++t) acc[t] += kr[t * D + d] * qd;
    }
    for (int t = 0; t < kTileKeys; ++t) *reinterpret_cast<vf16*>(scores + (j0 + t) * 16) = acc[t];
  }
  // Softmax per lane over its own keys (with its head's sink); keys outside them weigh 0.
  vi16 first_v, end_v;
  for (int i = 0; i < 16; ++i) {
    first_v[i] = static_cast<int32_t>(first[i] - lo);
    end_v[i] = static_cast<int32_t>(end[i] - lo);
  }
  const vf16 none = vf16{} - INFINITY;
  vf16 top = none;
  for (int64_t j = 0; j < keys; ++j) {
    const vi16 in = (first_v <= static_cast<int32_t>(j)) & (end_v > static_cast<int32_t>(j));
    const vf16 s = *reinterpret_cast<const vf16*>(scores + j * 16);
    top = in ? (s > top ? s : top) : top;
  }
  vf16 sink = none;
  if (sinks != nullptr) {
    for (int i = 0; i < 16; ++i) sink[i] = sinks[i % G];
    top = sink > top ? sink : top;
  }
  vf16 total = vf16{};
  for (int64_t j = 0; j < keys; ++j) {
    const vi16 in = (first_v <= static_cast<int32_t>(j)) & (end_v > static_cast<int32_t>(j));
    vf16* s = reinterpret_cast<vf16*>(scores + j * 16);
    const vf16 p = in ? fast_exp16(*s - top) : vf16{};
    *s = p;
    total += p;
  }
  float inv[16];
  for (int i = 0; i < 16; ++i) {
    if (sinks != nullptr) total[i] += std::exp(sink[i] - top[i]);
    inv[i] = 1.f / total[i];
  }
  // out_i = sum_j p[j][i] v_j: per 16 values of D, kTileLanes lanes at a time.
  for (int l0 = 0; l0 < lanes; l0 += kTileLanes) {
    for (int c = 0; c < D / 16; ++c) {
      vf16 acc[kTileLanes];
      for (int l = 0; l < kTileLanes; ++l) acc[l] = vf16{};
      for (int64_t j = 0; j < keys; ++j) {
        const vf16 val = load16(v_head + offsets[j] + c * 16);
        const float* p = scores + j * 16 + l0;
        for (int l = 0; l < kTileLanes; ++l) acc[l] += p[l] * val;
      }
      for (int l = 0; l < kTileLanes && l0 + l < lanes; ++l) {
        const int i = l0 + l;
        store16(out + rows[i / G] * q_row_stride + (h * G + i % G) * D + c * 16, acc[l] * inv[i]);
      }
    }
  }
}

#endif

// Contiguous runs of (row, KV head) items of about equal work (a row costs the keys it
// attends to, within its window, plus a fixed part), one per thread: prefill rows attend to
// anything from 1 to thousands of keys, so an even split of items could leave one thread with
// most of the keys.
std::vector<int64_t> split_by_cost(const int32_t* limit, int64_t num_rows, int64_t kv_heads,
                                   int64_t parts, int64_t window) {
  constexpr int64_t kRowCost = 32;  // a row's fixed work (query load, softmax, stores) in keys
  int64_t total = 0;
  for (int64_t r = 0; r < num_rows; ++r) total += row_keys(limit[r], window).count + kRowCost;
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t r = 0; r < num_rows && static_cast<int64_t>(bounds.size()) < parts; ++r) {
    done += row_keys(limit[r], window).count + kRowCost;
    if (done * parts >= total * static_cast<int64_t>(bounds.size()))
      bounds.push_back((r + 1) * kv_heads);
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) bounds.push_back(num_rows * kv_heads);
  bounds.back() = num_rows * kv_heads;
  return bounds;
}

template <typename scalar_t, int D, int G>
void attend(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& rows, const at::Tensor& req, const at::Tensor& limit,
    const at::Tensor& tables, double scale, int64_t grain, const SinkWindow& extra) {
  const int64_t num_rows = rows.size(0);
  const int64_t kv_heads = k_cache.size(0);
  const int64_t block_size = k_cache.size(2);
  const int64_t dim = k_cache.size(3);
  const int64_t heads = q.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t table_width = tables.size(1);

  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int32_t* req_p = req.data_ptr<int32_t>();
  const int32_t* limit_p = limit.data_ptr<int32_t>();
  const int32_t* table_p = tables.data_ptr<int32_t>();
  // Strides of the caches [KVH, NB, BS, D] and of q / out [T, H, D] (all contiguous).
  const int64_t k_head_stride = k_cache.stride(0);
  const int64_t block_stride = k_cache.stride(1);
  const int64_t q_row_stride = q.stride(0);

  const int64_t items = num_rows * kv_heads;
  const int64_t parts = items < grain ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const std::vector<int64_t> bounds =
      split_by_cost(limit_p, num_rows, kv_heads, parts, extra.window);
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
#ifdef TOKENMILL_VECTOR_ATTENTION
    if constexpr (G > 0) {  // fp32 only (attend_group)
      // A lone row of its request (decode) takes attend_row_vec; rows with company from their
      // request (a prefill chunk, a verification) go in tiles (attend_tile). Whether a row has
      // company is read from the whole step, not from this thread's share, so a row takes the
      // same path however the step is split. Shares start at a row (split_by_cost).
      constexpr int64_t kTileRows = 16 / G;
      std::vector<int64_t> offsets;
      auto alone = [&](int64_t r) {
        return (r == 0 || req_p[r - 1] != req_p[r]) &&
               (r + 1 == num_rows || req_p[r + 1] != req_p[r]);
      };
      for (int64_t r = begin / kv_heads; r < end / kv_heads;) {
        const int32_t* table = table_p + static_cast<int64_t>(req_p[r]) * table_width;
        if (alone(r)) {
          const int64_t row = rows_p[r];
          const KeySpan span = row_keys(limit_p[r], extra.window);
          scores.resize(G * span.count);
          for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t q_off = row * q_row_stride + h * G * dim;
            attend_row_vec<D, G>(qp + q_off, kp + h * k_head_stride, vp + h * k_head_stride,
                                 table, span, block_size, block_stride,
                                 static_cast<float>(scale),
                                 extra.sinks != nullptr ? extra.sinks + h * G : nullptr,
                                 scores.data(), op + q_off);
          }
          ++r;
          continue;
        }
        int64_t n = 1;
        while (n < kTileRows && r + n < end / kv_heads && req_p[r + n] == req_p[r]) ++n;
        for (int64_t h = 0; h < kv_heads; ++h)
          attend_tile<D, G>(qp, q_row_stride, rows_p + r, limit_p + r, n, h,
                            kp + h * k_head_stride, vp + h * k_head_stride, table, block_size,
                            block_stride, static_cast<float>(scale),
                            extra.sinks != nullptr ? extra.sinks + h * G : nullptr, extra.window,
                            scores, offsets, op);
        r += n;
      }
      return;
    }
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads;
      const int64_t h = item % kv_heads;
      const int64_t row = rows_p[r];
      const KeySpan span = row_keys(limit_p[r], extra.window);
      const int32_t* table = table_p + static_cast<int64_t>(req_p[r]) * table_width;
      const int64_t q_off = row * q_row_stride + h * group * dim;
      // The sinks of the G query heads h * G .. h * G + G - 1 (q's head order).
      const float* sinks = extra.sinks != nullptr ? extra.sinks + h * group : nullptr;
      scores.resize(group * span.count);
      attend_row<scalar_t, D>(qp + q_off, kp + h * k_head_stride, vp + h * k_head_stride, table,
                              span, block_size, block_stride, group, dim,
                              static_cast<float>(scale), sinks, scores.data(), op + q_off);
    }
  };
  if (parts == 1) {
    run(0, items);
    return;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) run(bounds[part], bounds[part + 1]);
  });
}

// The head size and group size of the common models get unrolled code (G = 0: any group).
template <typename scalar_t, int D>
void attend_group(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& req,
                  const at::Tensor& limit, const at::Tensor& tables, double scale,
                  int64_t grain, const SinkWindow& extra) {
  // Only fp32 with a head size of 64 or 128 has a vector path per group size; every other
  // combination is one instance of the plain loop (fewer instances: a shorter first build).
  constexpr bool vector = std::is_same_v<scalar_t, float> && D > 0;
  const int64_t group = vector ? q.size(1) / k_cache.size(0) : 0;
#define TOKENMILL_GROUP_CASE(n)                                                                \
  case n:                                                                                      \
    return attend<scalar_t, D, vector ? n : 0>(out, q, k_cache, v_cache, rows, req, limit,     \
                                               tables, scale, grain, extra);
  switch (group) {
    TOKENMILL_GROUP_CASE(1)
    TOKENMILL_GROUP_CASE(2)
    TOKENMILL_GROUP_CASE(3)
    TOKENMILL_GROUP_CASE(4)
    TOKENMILL_GROUP_CASE(5)
    TOKENMILL_GROUP_CASE(6)
    TOKENMILL_GROUP_CASE(7)
    TOKENMILL_GROUP_CASE(8)
    default:
      return attend<scalar_t, D, 0>(out, q, k_cache, v_cache, rows, req, limit, tables, scale,
                                    grain, extra);
  }
#undef TOKENMILL_GROUP_CASE
}

// The sinks as the fp32 [H] the kernel reads (a bf16 model's stay bf16 in the model: the
// copy is H floats per call); undefined where there are none.
at::Tensor sinks_fp32(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  TORCH_CHECK(sinks->device().is_cpu() && at::isFloatingType(sinks->scalar_type()),
              "paged_attention: sinks must be a floating CPU tensor");
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == heads, "paged_attention: sinks of shape ",
              sinks->sizes(), ", expected one per query head (", heads, ")");
  return sinks->to(at::kFloat).contiguous();
}

// out[rows] = attention of q[rows] over each row's paged context (see the file comment).
void paged_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& rows, const at::Tensor& req, const at::Tensor& limit,
    const at::Tensor& tables, double scale, int64_t grain, const std::optional<at::Tensor>& sinks,
    int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "paged_attention: q/out contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: K and V differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention: q and cache dtype");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "paged_attention: out dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && req.scalar_type() == at::kInt &&
                  limit.scalar_type() == at::kInt && tables.scalar_type() == at::kInt,
              "paged_attention: index dtypes");
  TORCH_CHECK(tables.is_contiguous(), "paged_attention: tables contiguous");
  // Indices are checked here, once per call and cheap next to the attention itself, so that a
  // bookkeeping bug upstream fails with a message instead of reading outside the cache. Plain
  // loops over the (small) index arrays: as torch reductions they were 16 ops and 8 host syncs
  // per call.
  TORCH_CHECK(rows.size(0) == req.size(0) && rows.size(0) == limit.size(0),
              "paged_attention: rows, req and limit differ in length");
  TORCH_CHECK(rows.is_contiguous() && req.is_contiguous() && limit.is_contiguous(),
              "paged_attention: rows, req and limit contiguous");
  const int64_t num_rows = rows.size(0);
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int32_t* req_p = req.data_ptr<int32_t>();
  const int32_t* limit_p = limit.data_ptr<int32_t>();
  const int64_t max_keys = tables.size(1) * k_cache.size(2);
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(rows_p[r] >= 0 && rows_p[r] < q.size(0), "paged_attention: row ", rows_p[r],
                " outside q (", q.size(0), " rows)");
    TORCH_CHECK(req_p[r] >= 0 && req_p[r] < tables.size(0), "paged_attention: table index ",
                req_p[r], " of row ", r, " outside tables (", tables.size(0), " rows)");
    TORCH_CHECK(limit_p[r] >= 1 && limit_p[r] <= max_keys, "paged_attention: row ", r,
                " attends to ", limit_p[r], " keys, more keys than its table holds (", max_keys,
                ")");
  }
  const int32_t* table_p = tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(1);
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(table_p[i] >= 0 && table_p[i] < num_blocks, "paged_attention: block id ",
                table_p[i], " outside the cache (", num_blocks, " blocks)");
  TORCH_CHECK(window >= 0, "paged_attention: window ", window, " is negative (0: no window)");
  const at::Tensor sink32 = sinks_fp32(sinks, q.size(1));
  const SinkWindow extra{sink32.defined() ? sink32.data_ptr<float>() : nullptr, window};
  const int64_t dim = k_cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged", [&] {
    // Head sizes of the common models get unrolled code.
    if (dim == 64) {
      attend_group<scalar_t, 64>(out, q, k_cache, v_cache, rows, req, limit, tables, scale, grain,
                                 extra);
    } else if (dim == 128) {
      attend_group<scalar_t, 128>(out, q, k_cache, v_cache, rows, req, limit, tables, scale,
                                  grain, extra);
    } else {
      attend_group<scalar_t, 0>(out, q, k_cache, v_cache, rows, req, limit, tables, scale, grain,
                                extra);
    }
  });
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, "
      "Tensor req, Tensor limit, Tensor tables, float scale, int grain, Tensor? sinks=None, "
      "int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_attention", &paged_attention); }
