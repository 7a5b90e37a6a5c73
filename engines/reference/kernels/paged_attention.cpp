// Attention of every query row of a step (decode tokens, speculative verifications, prefill
// chunks) over the paged KV cache, read in place: no gathered copy of any request's context.
//
// For every query row r (a token of the step's flat batch) and KV head h, the G query heads
// sharing h are scored against keys 0 .. limit[r] - 1 of the row's request, key j living in
// block table[req[r]][j / block_size] at offset j % block_size of the cache. Scores and the
// softmax are kept in fp32. In fp32 with the common head sizes, each K and V row is read once
// for all G heads (attend_row_vec); other dtypes and shapes take a plain loop per head
// (attend_row), whose re-reads come from the core's cache. Work is split over (row, KV head)
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
// L2, and scoring one row at a time beat torch's flash-attention SDPA (which runs its small
// GEMMs through MKL's AVX2 code on AMD) by 2.4x on 4 x 500-token prompts, and it needs no
// gathered copy of a chunk's cached history.
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
#ifdef TOKENMILL_VECTOR_ATTENTION
      if constexpr (G > 0) {  // fp32 only (attend_group)
        attend_row_vec<D, G>(qp + q_off, kp + h * k_head_stride, vp + h * k_head_stride, table,
                             span, block_size, block_stride, static_cast<float>(scale), sinks,
                             scores.data(), op + q_off);
        continue;
      }
#endif
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
