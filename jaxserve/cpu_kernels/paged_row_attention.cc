// Paged attention by query rows for XLA:CPU, called through the XLA FFI (see jaxserve/cpu_ffi.py).
//
// Every query row (a decode row, or one row of a prompt chunk) attends to its keys 0..kv_len-1,
// kv_len being the row's own position + 1, read in place from the page arrays
// [num_layers, num_pages, page_size, num_kv_heads, head_dim] through its sequence's block table.
// Rows are spread over XLA's intra-op threads; each makes two passes, scores over the keys and
// then the softmax-weighted sum of the values, each key and value row read straight from its page.
// The rows of one prompt chunk share their keys, which stay in the cache from row to row.
// XLA's gather-based version (attention.py) copies every page first, on one thread.
//
// float32 only. A row with kv_len 0 (padding) gets zeros.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Everything the rows' attention needs; pointers into XLA's buffers, `k`/`v` at the layer's start.
struct Problem {
  const float *q, *k, *v;
  const int32_t *kv_lens, *row_seqs, *tables;
  float* out;
  int64_t num_table_rows, num_heads, head_dim, group, num_pages, page_size, token_stride, table_width, window;
  float scale, soft_cap;
};

struct Scratch {
  std::vector<float> scores, acc, row_max, row_sum;
};

// Attention of query row `row`: a pass over its keys for the scores, the softmax, and
// a pass over its values. Each page is one contiguous [page_size, KVH, D] block, read in place, all
// heads at once; the next page is prefetched while one is read.
void AttendOne(const Problem& p, int64_t row, Scratch& scratch) {
  const int64_t num_heads = p.num_heads, head_dim = p.head_dim, page_size = p.page_size;
  const float* q_rows = p.q + row * num_heads * head_dim;
  float* out_rows = p.out + row * num_heads * head_dim;
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[row], p.table_width * page_size);
  const int64_t start = p.window > 0 ? std::max<int64_t>(kv_len - p.window, 0) : 0;
  const int64_t count = std::max<int64_t>(kv_len - start, 0);
  auto& [scores, acc, row_max, row_sum] = scratch;
  acc.assign(num_heads * head_dim, 0.0f);
  row_max.assign(num_heads, -std::numeric_limits<float>::max());
  row_sum.assign(num_heads, 0.0f);
  scores.resize(count * num_heads);
  const int32_t* table = p.tables + std::clamp<int64_t>(p.row_seqs[row], 0, p.num_table_rows - 1) * p.table_width;
  auto page_of = [&](int64_t pos) { return std::clamp<int64_t>(table[pos / page_size], 0, p.num_pages - 1); };
  const int64_t page_floats = page_size * p.token_stride;
  // fn(index from start, the key's or value's [KVH, D] row) for keys start..kv_len-1, page by page.
  auto for_each_key = [&](const float* pages, auto&& fn) {
    for (int64_t pos = start; pos < kv_len;) {
      const int64_t page_end = (pos / page_size + 1) * page_size, end = std::min(kv_len, page_end);
      if (page_end < kv_len) {
        const float* next = pages + page_of(page_end) * page_floats;
        for (int64_t line = 0; line < page_floats; line += 16) __builtin_prefetch(next + line);
      }
      const float* row = pages + page_of(pos) * page_floats + (pos % page_size) * p.token_stride;
      for (; pos < end; ++pos, row += p.token_stride) fn(pos - start, row);
    }
  };
  for_each_key(p.k, [&](int64_t i, const float* keys) {
    float* row_scores = scores.data() + i * num_heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* query = q_rows + h * head_dim;
      const float* key = keys + (h / p.group) * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
      float s = dot * p.scale;
      if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      row_scores[h] = s;
      row_max[h] = std::max(row_max[h], s);
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float e = std::exp(scores[i * num_heads + h] - row_max[h]);
      scores[i * num_heads + h] = e;
      row_sum[h] += e;
    }
  }
  for_each_key(p.v, [&](int64_t i, const float* values) {
    const float* weights = scores.data() + i * num_heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float w = weights[h];
      const float* value = values + (h / p.group) * head_dim;
      float* a = acc.data() + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * value[d];
    }
  });
  for (int64_t h = 0; h < num_heads; ++h) {
    const float inv = row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) out_rows[h * head_dim + d] = acc[h * head_dim + d] * inv;
  }
}

// Rows are handed out one at a time from a shared counter to this thread and to helpers on
// XLA's own intra-op thread pool (so nothing oversubscribes the cores XLA's matmuls use). The call
// returns once every handed-out row is done; a helper that starts late finds no work left.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> busy{0};
};

void Drain(const Problem& p, int64_t num_rows, Shared& shared) {
  Scratch scratch;
  for (int64_t row; (row = shared.next.fetch_add(1)) < num_rows;) AttendOne(p, row, scratch);
}

ffi::Error PagedRowAttention(ffi::ThreadPool pool,
                             ffi::Buffer<ffi::F32> q,               // [R, H, D]
                             ffi::Buffer<ffi::F32> k_pages,         // [L, P, page, KVH, D]
                             ffi::Buffer<ffi::F32> v_pages,         // [L, P, page, KVH, D]
                             ffi::Buffer<ffi::S32> layer,           // []
                             ffi::Buffer<ffi::S32> kv_lens,         // [R]
                             ffi::Buffer<ffi::S32> row_seqs,        // [R], the row's block table
                             ffi::Buffer<ffi::S32> block_tables,    // [S, W]
                             ffi::Buffer<ffi::S32> sliding_window,  // [], 0 = none
                             float scale, float soft_cap,
                             ffi::ResultBuffer<ffi::F32> out) {     // [R, H, D]
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_pages.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 5 || block_tables.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged_row_attention: unexpected operand ranks");
  }
  const int64_t num_rows = q_dims[0], num_heads = q_dims[1], head_dim = q_dims[2];
  const int64_t num_pages = kv_dims[1], page_size = kv_dims[2], num_kv_heads = kv_dims[3];
  if (kv_dims[4] != head_dim || num_heads % num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_row_attention: head shapes do not match");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= kv_dims[0]) {
    return ffi::Error::InvalidArgument("paged_row_attention: layer index out of range");
  }
  const int64_t layer_offset = layer_index * num_pages * page_size * num_kv_heads * head_dim;
  const Problem problem{q.typed_data(), k_pages.typed_data() + layer_offset, v_pages.typed_data() + layer_offset,
                        kv_lens.typed_data(), row_seqs.typed_data(), block_tables.typed_data(), out->typed_data(),
                        block_tables.dimensions()[0], num_heads, head_dim, num_heads / num_kv_heads, num_pages, page_size,
                        num_kv_heads * head_dim, block_tables.dimensions()[1], sliding_window.typed_data()[0],
                        scale, soft_cap};
  auto shared = std::make_shared<Shared>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_rows) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared, problem, num_rows] {
      shared->busy.fetch_add(1);
      Drain(problem, num_rows, *shared);
      shared->busy.fetch_sub(1);
    });
  }
  Drain(problem, num_rows, *shared);
  while (shared->busy.load() > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedRowAttention, PagedRowAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
