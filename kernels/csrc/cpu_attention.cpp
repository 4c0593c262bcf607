// Attention of output queries over a paged KV cache on the CPU, each query on its own
// (kernels/paged_attention.py calls it; cpu_fused.cpp registers it).
//
// A decode step's queries are single tokens (or a few: drafts, forced runs), each over its own
// row's cached keys. SDPA needs those keys gathered into one padded tensor and one call per
// query rank, ~30 us of dispatch a call; here one call per layer reads the keys where they lie
// (through the block table) and computes every query alone: the same arithmetic in the same
// order whatever else the step holds, so a token's output never depends on the batch, on the
// other queries of its row, or on the thread count.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vector_exp.h"

#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
namespace {

constexpr int64_t kLanes = 16;

struct Cache {
  const float* keys;
  const float* values;
  int64_t block_size, kv_heads, head_dim;
  const float* at(const float* base, int64_t block, int64_t slot, int64_t kv_head) const {
    return base + ((block * block_size + slot) * kv_heads + kv_head) * head_dim;
  }
};

struct Query {
  const float* q;  // its first head
  float* out;
  int64_t low, seen;
};

// One query head over keys low .. seen - 1 (`offsets[pos]`: where position pos's keys and values
// of kv head 0 start): softmax(q . k * scale) . v into out. The same arithmetic in the same order
// for a query whatever else is attended with it. Chunks: head_dim / 16 (a compile-time count
// keeps the accumulators in registers; 0 reads it from `chunks`).
template <int kChunks>
void attend_head(const float* q, float* out, const Cache& cache, const int64_t* offsets, int64_t kv_head,
                 int64_t low, int64_t seen, float scale, int64_t chunks_at_run_time, std::vector<float>& scores) {
  const int64_t chunks = kChunks > 0 ? kChunks : chunks_at_run_time, n = seen - low;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(padded);
  const float* keys = cache.keys + kv_head * cache.head_dim;
  const float* values = cache.values + kv_head * cache.head_dim;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {  // scores: one fixed reduction per key
    const float* k = keys + offsets[low + j];
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t c = 1; c < chunks; ++c)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * kLanes), _mm512_loadu_ps(k + c * kLanes), acc);
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
    top = std::max(top, scores[j]);
  }
  const __m512 vtop = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += kLanes) {  // softmax numerators in place, their sum
    const __mmask16 live = n - j >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e =
        _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores.data() + j), vtop)));
    _mm512_storeu_ps(scores.data() + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  constexpr int kHeld = kChunks > 0 ? kChunks : 16;
  __m512 acc[kHeld];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {  // the weighted values, keys in order
    const float* v = values + offsets[low + j];
    const __m512 weight = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + c * kLanes), acc[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + c * kLanes, _mm512_div_ps(acc[c], total));
}

using HeadKernel = void (*)(const float*, float*, const Cache&, const int64_t*, int64_t, int64_t, int64_t, float,
                            int64_t, std::vector<float>&);

HeadKernel head_kernel(int64_t chunks) {
  switch (chunks) {
    case 4: return attend_head<4>;   // head_dim 64
    case 8: return attend_head<8>;   // head_dim 128
    default: return chunks <= 16 ? attend_head<0> : nullptr;
  }
}

}  // namespace
#endif

// out[t] = softmax(query[t] . keys) . values for each item (row, t, low, seen) of `items`
// [Q, 4] int64: query token t of cache row `row` over its keys low .. seen - 1, read through
// block_tables [R, B] int32. query/out [T, H, D] float32 (last dimension contiguous), caches
// [blocks, block_size, KV, D] float32 contiguous, D a multiple of 16.
void output_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_tables, torch::Tensor items, double scale) {
#if defined(__AVX512F__)
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 &&
                  k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "output_attention: float32 query, out and caches expected");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
              "output_attention: query and out [T, H, D] with a contiguous last dimension");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4,
              "output_attention: contiguous caches [blocks, block_size, KV, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "output_attention: block_tables int32 [R, B]");
  TORCH_CHECK(items.scalar_type() == torch::kInt64 && items.dim() == 2 && items.size(1) == 4 && items.is_contiguous(),
              "output_attention: items int64 [Q, 4]");
  const int64_t heads = query.size(1), head_dim = query.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0 && head_dim % kLanes == 0,
              "output_attention: unsupported head shape");
  const Cache cache{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1), kv_heads, head_dim};
  const HeadKernel kernel = head_kernel(head_dim / kLanes);
  TORCH_CHECK(kernel != nullptr, "output_attention: head_dim up to 256");
  const int64_t group = heads / kv_heads, count = items.size(0);
  const int64_t* item = items.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0), max_blocks = block_tables.size(1);
  std::vector<int64_t> row_starts;  // items of one row are consecutive: one task maps its positions once
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* it = item + 4 * i;
    TORCH_CHECK(it[0] >= 0 && it[0] < block_tables.size(0) && it[1] >= 0 && it[1] < query.size(0) && it[2] >= 0 &&
                    it[2] < it[3] && it[3] <= max_blocks * cache.block_size,
                "output_attention: item ", i, " out of range");
    if (i == 0 || it[0] != it[-4]) row_starts.push_back(i);
  }
  row_starts.push_back(count);
  const int64_t rows = static_cast<int64_t>(row_starts.size()) - 1;
  // few rows: split each row by kv head so every core reads keys (no result changes)
  const int64_t splits = rows >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const float* q_base = query.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, rows * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first_item = row_starts[task / splits], last_item = row_starts[task / splits + 1];
      const int32_t* table = tables + item[4 * first_item] * table_stride;
      int64_t seen = 0;
      for (int64_t i = first_item; i < last_item; ++i) seen = std::max(seen, item[4 * i + 3]);
      offsets.resize(seen);
      for (int64_t pos = 0; pos < seen; ++pos)  // a position's keys of kv head 0, in floats
        offsets[pos] = (int64_t(table[pos / cache.block_size]) * cache.block_size + pos % cache.block_size) *
                       kv_heads * head_dim;
      const int64_t g0 = splits == 1 ? 0 : task % splits, g1 = splits == 1 ? kv_heads : g0 + 1;
      for (int64_t i = first_item; i < last_item; ++i) {
        const int64_t* it = item + 4 * i;
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            kernel(q_base + it[1] * query.stride(0) + h * query.stride(1),
                   out_base + it[1] * out.stride(0) + h * out.stride(1), cache, offsets.data(), g, it[2], it[3],
                   scale_f, head_dim / kLanes, scores);
      }
    }
  });
#else
  TORCH_CHECK(false, "output_attention needs AVX-512 (check panel_kernel_vectorised)");
#endif
}
