// Inverse-CDF sampling of float32 logit rows on the CPU in one pass per row (sampler/ops.py
// calls it; cpu_fused.cpp registers it).
//
// torch's route, exp over the row then a float64 cumsum and two searches, costs ~0.3 ms a row
// at a 49k vocabulary, most of it in exp's slow path for the -inf of banned tokens and the
// denormals of very unlikely ones. Here the weights come from one vector exp that never meets a
// denormal, and the cumulative sum is taken over blocks of 16 (each block's sum a fixed vector
// reduction), then token by token inside the one block where u * total falls: a row's token
// depends only on the row and its uniform.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vector_exp.h"

#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
namespace {

constexpr int64_t kLanes = 16;

// exp(x - top) for the 16 logits at `x` (`live` of them), zero where the logit is -inf or NaN.
inline __m512 weights16(const float* x, __mmask16 live, __m512 top) {
  const __m512 logits = _mm512_maskz_loadu_ps(live, x);
  const __mmask16 finite = _mm512_mask_cmp_ps_mask(live, logits, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                   _CMP_GT_OQ);  // false for -inf and NaN
  return _mm512_maskz_mov_ps(finite, exp_nonpositive(_mm512_sub_ps(logits, top)));
}

inline double block_sum(__m512 w) {
  const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(w));
  const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  return _mm512_reduce_add_pd(_mm512_add_pd(low, high));
}

inline __mmask16 live_lanes(int64_t left) {
  return left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

float row_max(const float* x, int64_t vocab) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < vocab; t += kLanes)  // NaN lanes keep the running max (max_ps's second operand)
    top = _mm512_max_ps(_mm512_mask_loadu_ps(top, live_lanes(vocab - t), x + t), top);
  return _mm512_reduce_max_ps(top);
}

// In block b (weights from logit index b * 16): the first token whose running sum from `before`
// exceeds `target`, else the block's last token with weight.
int64_t pick_in_block(const float* x, int64_t vocab, int64_t b, __m512 top, double before, double target) {
  alignas(64) float w[kLanes];
  _mm512_store_ps(w, weights16(x + b * kLanes, live_lanes(vocab - b * kLanes), top));
  int64_t last = 0;
  for (int64_t j = 0; j < kLanes; ++j) {
    if (w[j] <= 0.0f) continue;
    last = j;
    before += w[j];
    if (before > target) return b * kLanes + j;
  }
  return b * kLanes + last;
}

int64_t sample_row(const float* x, int64_t vocab, double u, std::vector<double>& sums) {
  const float top = row_max(x, vocab);
  if (!(top > -std::numeric_limits<float>::infinity())) return 0;  // nothing allowed: the caller guards
  const __m512 vtop = _mm512_set1_ps(top);
  const int64_t blocks = (vocab + kLanes - 1) / kLanes;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum(weights16(x + b * kLanes, live_lanes(vocab - b * kLanes), vtop));
    total += sums[b];
  }
  const double target = u * total;
  double before = 0.0;
  int64_t last_with_weight = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] > 0.0) last_with_weight = b;
    if (before + sums[b] > target) return pick_in_block(x, vocab, b, vtop, before, target);
    before += sums[b];
  }
  // u * total rounded up to the total: the last token with weight
  return pick_in_block(x, vocab, last_with_weight, vtop, total, std::numeric_limits<double>::infinity());
}

}  // namespace
#endif

// One token per row of logits [R, V] (float32, last dimension contiguous) from softmax(row),
// driven by uniforms [R] (float64, in [0, 1)): never a token whose logit is -inf.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor uniforms) {
#if defined(__AVX512F__)
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "sample_rows: float32 logits [R, V] on the CPU with a contiguous last dimension");
  const auto u = uniforms.to(torch::kFloat64).contiguous();
  TORCH_CHECK(u.dim() == 1 && u.size(0) == logits.size(0), "sample_rows: uniforms [R]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, torch::kInt64);
  int64_t* chosen = out.data_ptr<int64_t>();
  const double* draws = u.data_ptr<double>();
  const float* base = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums;
    for (int64_t r = begin; r < end; ++r) chosen[r] = sample_row(base + r * logits.stride(0), vocab, draws[r], sums);
  });
  return out;
#else
  TORCH_CHECK(false, "sample_rows needs AVX-512 (check panel_kernel_vectorised)");
  return logits;
#endif
}
