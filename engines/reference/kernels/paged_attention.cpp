// Attention of short query chunks (decode tokens, speculative verifications) over the paged KV
// cache, read in place: no gathered copy of any request's context.
//
// For every query row r (a token of the step's flat batch) and KV head h, the G query heads
// sharing h are scored against keys 0 .. limit[r] - 1 of the row's request, key j living in
// block table[req[r]][j / block_size] at offset j % block_size of the cache. Scores and the
// softmax are kept in fp32; K and V rows are read where they lie (from memory for the first
// head of a KV head, from the core's cache for the others). Work is split over (row, KV head)
// pairs; a step with fewer pairs than `grain` runs on the calling thread (waking OpenMP
// workers costs more than a small step's work).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// One (query row, KV head): the G heads' scores over the row's keys, softmax, then the
// weighted sum of V. D is a compile-time constant for the common head sizes, so a head's
// query and its output accumulator stay in registers; heads are taken one at a time so they
// do (the row's K and V, re-read per head, come from the core's L2).
template <typename scalar_t, int D>
inline void attend_row(
    const scalar_t* __restrict q_row, const scalar_t* __restrict k_head,
    const scalar_t* __restrict v_head, const int32_t* __restrict table, int64_t keys,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t dim, float scale,
    float* __restrict scores, scalar_t* __restrict o_row) {
  const int64_t d_len = D > 0 ? D : dim;
  for (int64_t g = 0; g < group; ++g) {
    float qg[D > 0 ? D : 1];
    std::vector<float> q_dyn(D > 0 ? 0 : d_len);
    float* qv = D > 0 ? qg : q_dyn.data();
    for (int64_t d = 0; d < d_len; ++d) qv[d] = to_float(q_row[g * d_len + d]) * scale;
    float* s = scores + g * keys;
    for (int64_t j = 0; j < keys;) {  // block by block: no division per key
      const int64_t off = j % block_size;
      const int64_t n = std::min(block_size - off, keys - j);
      const scalar_t* kb = k_head + table[j / block_size] * block_stride + off * d_len;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* kr = kb + t * d_len;
        float dot = 0.f;
        for (int64_t d = 0; d < d_len; ++d) dot += qv[d] * to_float(kr[d]);
        s[j + t] = dot;
      }
      j += n;
    }
    const float top = *std::max_element(s, s + keys);  // softmax, max-subtracted
    float total = 0.f;
    for (int64_t j = 0; j < keys; ++j) {
      s[j] = tokenmill::fast_exp(s[j] - top);
      total += s[j];
    }
    const float inv = 1.f / total;
    float acc[D > 0 ? D : 1];
    std::vector<float> acc_dyn(D > 0 ? 0 : d_len);
    float* av = D > 0 ? acc : acc_dyn.data();
    for (int64_t d = 0; d < d_len; ++d) av[d] = 0.f;
    for (int64_t j = 0; j < keys;) {
      const int64_t off = j % block_size;
      const int64_t n = std::min(block_size - off, keys - j);
      const scalar_t* vb = v_head + table[j / block_size] * block_stride + off * d_len;
      for (int64_t t = 0; t < n; ++t) {
        const float p = s[j + t];
        const scalar_t* vr = vb + t * d_len;
        for (int64_t d = 0; d < d_len; ++d) av[d] += p * to_float(vr[d]);
      }
      j += n;
    }
    for (int64_t d = 0; d < d_len; ++d) o_row[g * d_len + d] = static_cast<scalar_t>(av[d] * inv);
  }
}

template <typename scalar_t, int D>
void attend(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& rows, const at::Tensor& req, const at::Tensor& limit,
    const at::Tensor& tables, double scale, int64_t grain) {
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

  at::parallel_for(0, num_rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads;
      const int64_t h = item % kv_heads;
      const int64_t row = rows_p[r];
      const int64_t keys = limit_p[r];
      scores.resize(group * keys);
      attend_row<scalar_t, D>(
          qp + row * q_row_stride + h * group * dim, kp + h * k_head_stride,
          vp + h * k_head_stride, table_p + static_cast<int64_t>(req_p[r]) * table_width, keys,
          block_size, block_stride, group, dim, static_cast<float>(scale), scores.data(),
          op + row * q_row_stride + h * group * dim);
    }
  });
}

// out[rows] = attention of q[rows] over each row's paged context (see the file comment).
void paged_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& rows, const at::Tensor& req, const at::Tensor& limit,
    const at::Tensor& tables, double scale, int64_t grain) {
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
  // bookkeeping bug upstream fails with a message instead of reading outside the cache.
  TORCH_CHECK(rows.size(0) == req.size(0) && rows.size(0) == limit.size(0),
              "paged_attention: rows, req and limit differ in length");
  if (rows.size(0) > 0) {
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < q.size(0),
                "paged_attention: a row outside q");
    TORCH_CHECK(req.min().item<int32_t>() >= 0 && req.max().item<int32_t>() < tables.size(0),
                "paged_attention: a row's table index outside tables");
    TORCH_CHECK(limit.min().item<int32_t>() >= 1 &&
                    limit.max().item<int32_t>() <= tables.size(1) * k_cache.size(2),
                "paged_attention: a row attends to more keys than its table holds");
    TORCH_CHECK(tables.min().item<int32_t>() >= 0 &&
                    tables.max().item<int32_t>() < k_cache.size(1),
                "paged_attention: a block id outside the cache");
  }
  const int64_t dim = k_cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention",
                                  [&] {
                                    // Head sizes of the common models get unrolled code.
                                    if (dim == 64) {
                                      attend<scalar_t, 64>(out, q, k_cache, v_cache, rows, req,
                                                           limit, tables, scale, grain);
                                    } else if (dim == 128) {
                                      attend<scalar_t, 128>(out, q, k_cache, v_cache, rows, req,
                                                            limit, tables, scale, grain);
                                    } else {
                                      attend<scalar_t, 0>(out, q, k_cache, v_cache, rows, req,
                                                          limit, tables, scale, grain);
                                    }
                                  });
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, "
      "Tensor req, Tensor limit, Tensor tables, float scale, int grain) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_attention", &paged_attention); }
