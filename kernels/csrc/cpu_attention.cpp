// Attention of queries over a paged KV cache on the CPU, each query on its own
// (kernels/paged_attention.py calls it; cpu_fused.cpp registers it).
//
// A decode step's queries are single tokens (or a few: drafts, forced runs), a prompt's are a
// chunk of it, each over its own row's cached keys. SDPA needs those keys gathered into one
// padded tensor and one call per query rank or cache block, ~30 us of dispatch a call; here one
// call per layer reads the keys where they lie (through the block table) and computes every
// query alone: the same arithmetic in the same order whatever else the step holds, so a token's
// output never depends on the batch, on the other queries of its row, or on the thread count.
//
// A query head's arithmetic: each score a 16-lane FMA chain over the head dimension summed as
// _mm512_reduce_add_ps sums, times the scale; the softmax's numerators exp(score - max) summed
// lane-wise over blocks of 16 keys and then across lanes; the weighted values accumulated key by
// key. The queries of a row that share their first key (and the heads that share a kv head) are
// computed together, a block of 16 keys at a time, so the keys and values are read once for all
// of them: that changes the order of the work, not of any query's sums.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vector_exp.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kTileQueries = 16;  // queries of one row attended together (their heads share the keys)

struct Cache {
  const float* keys;
  const float* values;
  int64_t block_size, kv_heads, head_dim;
};

// The lane sums of 16 vectors, lane l of the result vector l's sum, each added as
// _mm512_reduce_add_ps adds (the halves, then the quarters, then pairs within a quarter: the
// same additions, so the same bits) but 16 at once.
inline __m512 lane_sums(const __m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)  // [x0..7 + x8..15 | y0..7 + y8..15]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // four vectors' 4-lane sums, one per 128-bit lane
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // lanes 0 + 2 and 1 + 3 of each quarter
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4 * m + q holds vector 4 * q + m's sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

inline __mmask16 live_lanes(int64_t left) {
  return left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// One query head of a tile: its query, output, keys seen (from the tile's first key) and scores.
struct Head {
  const float* q;
  float* out;
  int64_t n;
  float* scores;  // n rounded up to 16
  float top, total;
};

// Scores of every head over the 16 keys at `keys` (those past a head's own keys are not read),
// their running maxima.
template <int kChunks>
void score_block(Head* heads, int64_t count, const float* const* keys, int64_t first, float scale, int64_t chunks_rt) {
  const int64_t chunks = kChunks > 0 ? kChunks : chunks_rt;
  for (int64_t h = 0; h < count; ++h) {
    Head& head = heads[h];
    if (head.n <= first) continue;
    __m512 dots[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) {
      const float* k = keys[l];
      if (first + l >= head.n) {
        dots[l] = _mm512_setzero_ps();
        continue;
      }
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(head.q), _mm512_loadu_ps(k));
      for (int64_t c = 1; c < chunks; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(head.q + c * kLanes), _mm512_loadu_ps(k + c * kLanes), acc);
      dots[l] = acc;
    }
    const __m512 scores = _mm512_mul_ps(lane_sums(dots), _mm512_set1_ps(scale));
    const __mmask16 live = live_lanes(head.n - first);
    _mm512_storeu_ps(head.scores + first, scores);
    head.top = std::max(head.top, _mm512_mask_reduce_max_ps(live, scores));
  }
}

// exp(score - max) in place over each head's keys, and their sum (lanes, then across lanes).
void softmax_numerators(Head& head) {
  const int64_t padded = (head.n + kLanes - 1) / kLanes * kLanes;
  const __m512 top = _mm512_set1_ps(head.top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += kLanes) {
    const __mmask16 live = live_lanes(head.n - j);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, head.scores + j), top)));
    _mm512_storeu_ps(head.scores + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  head.total = _mm512_reduce_add_ps(sum);
}

// out = sum_j e_j v_j / total for kM heads at once (keys in order for each), values[j] the value
// row of the tile's key j.
template <int kChunks, int kM>
void weigh_values(Head* heads, const float* const* values) {
  __m512 acc[kM][kChunks];
  int64_t common = heads[0].n, longest = heads[0].n;
  for (int m = 0; m < kM; ++m) {
    for (int c = 0; c < kChunks; ++c) acc[m][c] = _mm512_setzero_ps();
    common = std::min(common, heads[m].n);
    longest = std::max(longest, heads[m].n);
  }
  for (int64_t j = 0; j < common; ++j) {
    const float* v = values[j];
    __m512 row[kChunks];
    for (int c = 0; c < kChunks; ++c) row[c] = _mm512_loadu_ps(v + c * kLanes);
    for (int m = 0; m < kM; ++m) {
      const __m512 weight = _mm512_set1_ps(heads[m].scores[j]);
      for (int c = 0; c < kChunks; ++c) acc[m][c] = _mm512_fmadd_ps(weight, row[c], acc[m][c]);
    }
  }
  for (int64_t j = common; j < longest; ++j) {
    const float* v = values[j];
    for (int m = 0; m < kM; ++m) {
      if (j >= heads[m].n) continue;
      const __m512 weight = _mm512_set1_ps(heads[m].scores[j]);
      for (int c = 0; c < kChunks; ++c) acc[m][c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + c * kLanes), acc[m][c]);
    }
  }
  for (int m = 0; m < kM; ++m) {
    const __m512 total = _mm512_set1_ps(heads[m].total);
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(heads[m].out + c * kLanes, _mm512_div_ps(acc[m][c], total));
  }
}

// Any head dimension (a multiple of 16 up to 256): one head at a time, the same arithmetic.
void weigh_values_any(Head& head, const float* const* values, int64_t chunks) {
  __m512 acc[16];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < head.n; ++j) {
    const __m512 weight = _mm512_set1_ps(head.scores[j]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values[j] + c * kLanes), acc[c]);
  }
  const __m512 total = _mm512_set1_ps(head.total);
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(head.out + c * kLanes, _mm512_div_ps(acc[c], total));
}

template <int kChunks>
void weigh_all(Head* heads, int64_t count, const float* const* values, int64_t chunks) {
  if constexpr (kChunks == 0) {
    for (int64_t h = 0; h < count; ++h) weigh_values_any(heads[h], values, chunks);
  } else {
    constexpr int kWide = 24 / kChunks;  // accumulators for kWide heads stay in registers
    int64_t h = 0;
    for (; h + kWide <= count; h += kWide) weigh_values<kChunks, kWide>(heads + h, values);
    for (; h < count; ++h) weigh_values<kChunks, 1>(heads + h, values);
  }
}

// One task: the queries of a tile (one row, one first key) over one kv head.
struct Task {
  int64_t first_item, last_item, kv_head, cost;
};

struct Problem {
  Cache cache;
  const int64_t* items;
  const int32_t* tables;
  int64_t table_stride, group;
  const float* q;
  float* out;
  int64_t q_stride0, q_stride1, out_stride0, out_stride1;
  float scale;
};

template <int kChunks>
void run_task(const Problem& p, const Task& task, std::vector<Head>& heads, std::vector<float>& scores,
              std::vector<const float*>& keys, std::vector<const float*>& values) {
  const int64_t* first_item = p.items + 4 * task.first_item;
  const int64_t low = first_item[2], head_dim = p.cache.head_dim, chunks = head_dim / kLanes;
  const int32_t* table = p.tables + first_item[0] * p.table_stride;
  int64_t longest = 0;
  for (int64_t i = task.first_item; i < task.last_item; ++i) longest = std::max(longest, p.items[4 * i + 3] - low);
  const int64_t padded = (longest + kLanes - 1) / kLanes * kLanes;
  keys.assign(padded, nullptr);
  values.assign(padded, nullptr);
  const int64_t kv_offset = task.kv_head * head_dim, bs = p.cache.block_size;
  for (int64_t j = 0; j < longest; ++j) {  // key j of the tile: position low + j, through the table
    const int64_t pos = low + j;
    const int64_t at = ((int64_t(table[pos / bs]) * bs + pos % bs) * p.cache.kv_heads) * head_dim + kv_offset;
    keys[j] = p.cache.keys + at;
    values[j] = p.cache.values + at;
  }
  const int64_t count = (task.last_item - task.first_item) * p.group;
  heads.resize(count);
  scores.resize(count * padded);
  for (int64_t i = task.first_item, h = 0; i < task.last_item; ++i)
    for (int64_t g = 0; g < p.group; ++g, ++h) {
      const int64_t* it = p.items + 4 * i;
      const int64_t head = task.kv_head * p.group + g;
      heads[h] = Head{p.q + it[1] * p.q_stride0 + head * p.q_stride1, p.out + it[1] * p.out_stride0 + head * p.out_stride1,
                      it[3] - low, scores.data() + h * padded, -std::numeric_limits<float>::infinity(), 0.0f};
    }
  for (int64_t first = 0; first < longest; first += kLanes)
    score_block<kChunks>(heads.data(), count, keys.data() + first, first, p.scale, chunks);
  for (Head& head : heads) softmax_numerators(head);
  weigh_all<kChunks>(heads.data(), count, values.data(), chunks);
}

using TaskRunner = void (*)(const Problem&, const Task&, std::vector<Head>&, std::vector<float>&,
                            std::vector<const float*>&, std::vector<const float*>&);

TaskRunner task_runner(int64_t chunks) {
  switch (chunks) {
    case 4: return run_task<4>;  // head_dim 64
    case 8: return run_task<8>;  // head_dim 128
    default: return chunks <= 16 ? run_task<0> : nullptr;
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
  const TaskRunner runner = task_runner(head_dim / kLanes);
  TORCH_CHECK(runner != nullptr, "output_attention: head_dim up to 256");
  const Problem problem{Cache{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1), kv_heads, head_dim},
                        items.data_ptr<int64_t>(), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                        heads / kv_heads, query.data_ptr<float>(), out.data_ptr<float>(), query.stride(0),
                        query.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
  const int64_t count = items.size(0), max_keys = block_tables.size(1) * k_cache.size(1);
  const int64_t* item = problem.items;
  std::vector<Task> tasks;  // tiles: consecutive items of one row with the same first key
  for (int64_t i = 0, start = 0; i < count; ++i) {
    const int64_t* it = item + 4 * i;
    TORCH_CHECK(it[0] >= 0 && it[0] < block_tables.size(0) && it[1] >= 0 && it[1] < query.size(0) && it[2] >= 0 &&
                    it[2] < it[3] && it[3] <= max_keys,
                "output_attention: item ", i, " out of range");
    const bool last = i + 1 == count || it[4] != it[0] || it[6] != it[2] || i + 1 - start == kTileQueries;
    if (!last) continue;
    int64_t longest = 0;
    for (int64_t t = start; t <= i; ++t) longest = std::max(longest, item[4 * t + 3] - item[4 * t + 2]);
    for (int64_t g = 0; g < kv_heads; ++g) tasks.push_back(Task{start, i + 1, g, (i + 1 - start) * longest});
    start = i + 1;
  }
  // the longest tasks first, each thread taking the next one free: a prompt's tiles differ in length
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<Head> tile_heads;
    std::vector<float> scores;
    std::vector<const float*> keys, values;
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++)
      runner(problem, tasks[t], tile_heads, scores, keys, values);
  });
#else
  TORCH_CHECK(false, "output_attention needs AVX-512 (check panel_kernel_vectorised)");
#endif
}
