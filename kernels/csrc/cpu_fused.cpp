// Small CPU ops fused into one call each (kernels/cpu_fused.py builds this): a decoder layer's
// float32 norms, rotary and activation, the quantized projections' casts, the sampler's bitmask.
//
// At one decode row the CPU step is bound by dispatch, not arithmetic: the torch references of
// these ops are 6-12 aten calls of a few microseconds each over a 576-wide row (the bitmask's
// expands every bit to an int32 first). Each function here does a whole row in one call, row by
// row (a row's result never depends on the others, so drafts and batching keep their outputs).
// Built with -ffp-contract=off: the rotary's products and sum round as the reference's separate
// ops do, bit for bit.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [N, D] with a contiguous last dimension");
}

}  // namespace

// residual += x (in place, when given), then RMSNorm of the sum (or of x) times weight: [N, D].
torch::Tensor add_rmsnorm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == width && weight.scalar_type() == torch::kFloat32,
              "weight must be a contiguous float32 [D]");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
  }
  auto out = torch::empty({rows, width}, x.options());
  const float* w = weight.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    float* source = x.data_ptr<float>() + i * x.stride(0);
    if (residual) {
      float* sum = residual->data_ptr<float>() + i * residual->stride(0);
      for (int64_t j = 0; j < width; ++j) sum[j] += source[j];
      source = sum;
    }
    double squares = 0.0;
    for (int64_t j = 0; j < width; ++j) squares += static_cast<double>(source[j]) * source[j];
    const float inverse = 1.0f / std::sqrt(static_cast<float>(squares / width) + static_cast<float>(eps));
    float* o = out.data_ptr<float>() + i * width;
    for (int64_t j = 0; j < width; ++j) o[j] = w[j] * (source[j] * inverse);
  }
  return out;
}

// Rotate each token's query and key heads (x * cos + rotate_half(x) * sin), store the keys and
// the values at the token's flat cache slot, return the queries [N, heads, head_dim].
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = qkv.size(0), head_dim = k_cache.size(-1), half = head_dim / 2;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads && head_dim % 2 == 0,
              "the caches must be [blocks, block_size, kv_heads, head_dim] with an even head_dim");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width does not match the heads");
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == head_dim && sin.sizes() == cos.sizes(), "cos/sin must be [N, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "the caches must be contiguous float32 and alike");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == tokens, "slots must be int64 [N]");
  const int64_t slot_width = num_kv_heads * head_dim, capacity = k_cache.numel() / slot_width;
  auto queries = torch::empty({tokens, num_heads, head_dim}, qkv.options());
  const auto slot = slots.contiguous();
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t at = slot.data_ptr<int64_t>()[i];
    TORCH_CHECK(at >= 0 && at < capacity, "cache slot ", at, " out of range");
    const float* row = qkv.data_ptr<float>() + i * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + i * cos.stride(0);
    const float* s = sin.data_ptr<float>() + i * sin.stride(0);
    float* keys = k_cache.data_ptr<float>() + at * slot_width;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      const float* x = row + h * head_dim;
      float* o = h < num_heads ? queries.data_ptr<float>() + (i * num_heads + h) * head_dim
                               : keys + (h - num_heads) * head_dim;
      for (int64_t j = 0; j < head_dim; ++j) {
        const float rotated = j < half ? -x[j + half] : x[j - half];
        const float direct = x[j] * c[j];
        const float turned = rotated * s[j];
        o[j] = direct + turned;
      }
    }
    const float* values = row + (num_heads + num_kv_heads) * head_dim;
    std::copy(values, values + slot_width, v_cache.data_ptr<float>() + at * slot_width);
  }
  return queries;
}

// silu(x[:, :I]) * x[:, I:] for x [N, 2I]: [N, I].
torch::Tensor silu_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [N, 2I]");
  auto out = torch::empty({rows, inner}, x.options());
  for (int64_t i = 0; i < rows; ++i) {
    const float* gate = x.data_ptr<float>() + i * x.stride(0);
    const float* up = gate + inner;
    float* o = out.data_ptr<float>() + i * inner;
    for (int64_t j = 0; j < inner; ++j) o[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
  }
  return out;
}

// A quantized projection of float32 rows: the rows to bf16, torch's int4 (groups with a scale
// and a zero point) or int8 (per output row) CPU kernel, the product back to float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, int64_t group_size, torch::Tensor scales) {
  return at::_weight_int4pack_mm_for_cpu(x.to(torch::kBFloat16), packed, group_size, scales).to(torch::kFloat32);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales) {
  return at::_weight_int8pack_mm(x.to(torch::kBFloat16), weight, scales).to(torch::kFloat32);
}

// x [M, K] @ w [N, K]^T (+ bias [N]) for float32 rows, any M: [M, N], from a copy of w packed once
// into panels of 48 weight rows, K-major ([P, K, 48], zero-padded): at each k a panel's 48 weights
// are three vectors and every row's x[k] is broadcast against them. Each output is one FMA chain
// over k = 0..K-1 in order from zero, then + bias: the same operations whatever M is and wherever
// the row sits, so a row's bits never depend on the rows beside it (drafts, batching, prompt
// chunks). Threads split the panels (and the rows in blocks of 64); 8-row register tiles keep the
// FMA units busy from ~8 rows, and one panel is read once for every row of a block.
namespace {

constexpr int64_t kPanel = 48;      // weight rows per panel: three 16-float vectors
constexpr int64_t kTileRows = 8;    // rows of x per register tile (24 accumulators)
constexpr int64_t kBlockRows = 64;  // rows of x per task
constexpr int64_t kPrefetchAhead = 24;  // k steps (24 x 192 bytes) ahead of the panel being read

// P panels side by side for few rows: a row's 3 accumulators per panel would otherwise wait on
// the FMA latency at every k; more panels give the FMA units independent chains. Which P a tile
// uses never changes an output's operations, only how many run at once.
constexpr int panels_for(int rows) { return rows == 1 ? 4 : rows <= 4 ? 2 : 1; }
constexpr int64_t kMaxGroup = 4;  // the most panels one tile takes

// A panel's weights are float32; int8 with one float32 scale per weight row (column of the
// output): an int8 output is the FMA chain over the integers, times its scale; or int4 (Q4_1 as
// kernels/quantized_linear.py quantizes it): two k steps per byte (low nibble first) and per
// group of kInt4Group k steps a bf16 scale and zero point per column, w = q * scale + (zero - 8 *
// scale) in one FMA (the second term once per group), then the FMA chain over those weights.
enum class Weights { kFloat32, kInt8, kInt4, kQ4Grid, kQ8Grid };
constexpr int64_t kInt4Group = 32;

template <Weights W>
struct Storage;
template <>
struct Storage<Weights::kFloat32> { using T = float; };
template <>
struct Storage<Weights::kInt8> { using T = int8_t; };
template <>
struct Storage<Weights::kInt4> { using T = uint8_t; };
// A float32 weight whose every group of 32 input columns lies on a GGUF grid, stored as the grid:
// Q4_1 (kQ4Grid, int4's bytes; w = q * d + m, one rounding, float16 d and m per group and column)
// or Q8_0 (kQ8Grid, int8's panels; w = q * d, exact, a float32 d per group and column). Decoded, the weights are the float32
// weight's bits, so the float32 panels' FMA chains give the same bits from a quarter or an eighth
// of the bytes.
template <>
struct Storage<Weights::kQ4Grid> { using T = uint8_t; };
template <>
struct Storage<Weights::kQ8Grid> { using T = int8_t; };
constexpr bool int4_bytes(Weights w) { return w == Weights::kInt4 || w == Weights::kQ4Grid; }

#if defined(__AVX512F__)
// The 16 float32 or int8 weights of columns 16c..16c+15 of a panel at k step i.
template <Weights W>
inline __m512 weights16(const typename Storage<W>::T* panel, int64_t i, int c) {
  if constexpr (W == Weights::kFloat32) {
    return _mm512_loadu_ps(panel + i * kPanel + 16 * c);
  } else {
    const auto* bytes = reinterpret_cast<const __m128i*>(panel + i * kPanel + 16 * c);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
  }
}

// scales: int8's column scales from the tile's first column; int4's group scales of the tile's
// first panel, scale_stride floats apart per panel; float32: nullptr
inline __m512 bf16_to_float(const uint16_t* values) {  // 16 bf16 values, exactly
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Group g's scales of column vector c of a panel: int4's bf16 (scale, zero point) pairs give
// w = q * scale + (zero - 8 * scale); a Q4_1 grid's float16 (d, m) give w = q * d + m.
template <bool Grid>
inline void group_scales(const float* scales, int64_t g, int c, __m512& scale, __m512& zero) {
  if constexpr (Grid) {
    const uint16_t* dm = reinterpret_cast<const uint16_t*>(scales) + g * 2 * kPanel;
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16 * c)));
    zero = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + kPanel + 16 * c)));
  } else {
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales) + g * 2 * kPanel;
    scale = bf16_to_float(sz + 16 * c);
    zero = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, bf16_to_float(sz + kPanel + 16 * c));
  }
}

// int4: a byte holds k steps 2j and 2j + 1, so each byte is read once for both and each
// group's scales once for its 32 steps; each output's chain is the same k by k.
template <int R, int P, bool Grid>
void int4_tile(const uint8_t* panel, int64_t panel_stride, int64_t k, const float* x, int64_t ldx,
               const float* scales, int64_t scale_stride, float* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][3 * P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3 * P; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < k / kInt4Group; ++g) {
    __m512 scale[3 * P], zero[3 * P];  // w = q * scale + zero
    for (int p = 0; p < P; ++p)  // scale_stride counts floats, as every kind's (int4 reads bf16 pairs there)
      for (int c = 0; c < 3; ++c) group_scales<Grid>(scales + p * scale_stride, g, c, scale[3 * p + c], zero[3 * p + c]);
    for (int64_t i = g * kInt4Group; i < (g + 1) * kInt4Group; i += 2) {
      __m512i both[3 * P];
      for (int p = 0; p < P; ++p) {
        const uint8_t* bytes = panel + p * panel_stride + (i / 2) * kPanel;
        for (int c = 0; c < 3; ++c)
          both[3 * p + c] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c)));
        _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchAhead * kPanel), _MM_HINT_T0);
      }
      for (int half = 0; half < 2; ++half) {
        __m512 w[3 * P];
        for (int c = 0; c < 3 * P; ++c) {
          const __m512i q = half ? _mm512_srli_epi32(both[c], 4) : _mm512_and_si512(both[c], low);
          w[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale[c], zero[c]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * ldx + i + half]);
          for (int c = 0; c < 3 * P; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3 * P; ++c) {
      const int64_t left = std::min<int64_t>(16, cols - 16 * c);
      if (left >= 16)
        _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]);
      else if (left > 0)
        _mm512_mask_storeu_ps(out + r * ldo + 16 * c, static_cast<__mmask16>((1u << left) - 1u), acc[r][c]);
    }
}

template <Weights W, int R, int P>
void panel_tile(const typename Storage<W>::T* panel, int64_t panel_stride, int64_t k, const float* x, int64_t ldx,
                const float* scales, int64_t scale_stride, float* out, int64_t ldo, int64_t cols) {
  if constexpr (int4_bytes(W)) {
    return int4_tile<R, P, W == Weights::kQ4Grid>(panel, panel_stride, k, x, ldx, scales, scale_stride, out, ldo, cols);
  }
  using T = typename Storage<W>::T;
  constexpr int64_t kBytesPerStep = int4_bytes(W) ? kPanel / 2 : kPanel * sizeof(T);
  constexpr int kLines = (kBytesPerStep + 63) / 64;  // cache lines per k step of a panel
  __m512 acc[R][3 * P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3 * P; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m512 w[3 * P];
    for (int p = 0; p < P; ++p) {
      const T* own = panel + p * panel_stride;
      for (int c = 0; c < 3; ++c) w[3 * p + c] = weights16<W>(own, i, c);
      if constexpr (W == Weights::kQ8Grid)  // q * d, exact: the weight's float32 value
        for (int c = 0; c < 3; ++c)
          w[3 * p + c] = _mm512_mul_ps(w[3 * p + c], _mm512_loadu_ps(scales + p * scale_stride + (i / kInt4Group) * kPanel + 16 * c));
      // the hardware's prefetcher alone left a large weight at ~0.8x MKL's pace
      const char* ahead = reinterpret_cast<const char*>(own) + (i + kPrefetchAhead) * kBytesPerStep;
      for (int line = 0; line < kLines; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
      for (int c = 0; c < 3 * P; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3 * P; ++c) {
      const int64_t left = std::min<int64_t>(16, cols - 16 * c);  // cols: of the P panels together
      if (left <= 0) continue;
      const __m512 value = W == Weights::kInt8 ? _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(scales + 16 * c)) : acc[r][c];
      if (left >= 16)
        _mm512_storeu_ps(out + r * ldo + 16 * c, value);
      else
        _mm512_mask_storeu_ps(out + r * ldo + 16 * c, static_cast<__mmask16>((1u << left) - 1u), value);
    }
}
#else
inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

template <Weights W, int R, int P>
void panel_tile(const typename Storage<W>::T* panel, int64_t panel_stride, int64_t k, const float* x, int64_t ldx,
                const float* scales, int64_t scale_stride, float* out, int64_t ldo, int64_t cols) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const auto* own = panel + (c / kPanel) * panel_stride;
      const int64_t col = c % kPanel;
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) {
        float w;
        if constexpr (W == Weights::kInt4) {
          const int q = (i & 1) ? own[(i / 2) * kPanel + col] >> 4 : own[(i / 2) * kPanel + col] & 15;
          const auto* sz = reinterpret_cast<const uint16_t*>(scales + (c / kPanel) * scale_stride) +
                           (i / kInt4Group) * 2 * kPanel;
          const float scale = bf16_value(sz[col]);
          w = std::fma(static_cast<float>(q), scale, std::fma(-8.0f, scale, bf16_value(sz[kPanel + col])));
        } else if constexpr (W == Weights::kQ4Grid) {
          const int q = (i & 1) ? own[(i / 2) * kPanel + col] >> 4 : own[(i / 2) * kPanel + col] & 15;
          const auto* dm = reinterpret_cast<const at::Half*>(scales + (c / kPanel) * scale_stride) +
                           (i / kInt4Group) * 2 * kPanel;
          w = std::fma(static_cast<float>(q), static_cast<float>(dm[col]), static_cast<float>(dm[kPanel + col]));
        } else if constexpr (W == Weights::kQ8Grid) {
          w = static_cast<float>(own[i * kPanel + col]) * scales[(c / kPanel) * scale_stride + (i / kInt4Group) * kPanel + col];
        } else {
          w = static_cast<float>(own[i * kPanel + col]);
        }
        acc = std::fma(x[r * ldx + i], w, acc);
      }
      out[r * ldo + c] = W == Weights::kInt8 ? acc * scales[c] : acc;
    }
}
#endif

template <Weights W>
using PanelTile = void (*)(const typename Storage<W>::T*, int64_t, int64_t, const float*, int64_t, const float*,
                           int64_t, float*, int64_t, int64_t);

// the tile for rows R: panels_for(R) panels side by side (wide) or one
template <Weights W, int R>
constexpr PanelTile<W> tile_for(bool wide) {
  constexpr int together = panels_for(R);
  return !wide ? panel_tile<W, R, 1> : together == 4 ? panel_tile<W, R, 4> : together == 2 ? panel_tile<W, R, 2>
                                                                                            : panel_tile<W, R, 1>;
}

template <Weights W>
PanelTile<W> tile(int rows, bool wide) {
  switch (rows) {
    case 1: return tile_for<W, 1>(wide);
    case 2: return tile_for<W, 2>(wide);
    case 3: return tile_for<W, 3>(wide);
    case 4: return tile_for<W, 4>(wide);
    case 5: return tile_for<W, 5>(wide);
    case 6: return tile_for<W, 6>(wide);
    case 7: return tile_for<W, 7>(wide);
    default: return tile_for<W, 8>(wide);
  }
}

// What one packed weight is: its panels (stride elements apart), its scales (scale_stride floats
// apart per panel; nullptr for float32), K and N.
template <Weights W>
struct PanelWeight {
  const typename Storage<W>::T* panels;
  int64_t stride;
  const float* scales;
  int64_t scale_stride;
  int64_t k;
  int64_t n;
  int64_t count;  // panels
};

#if defined(__AVX512F__)
constexpr int64_t kChunkSteps = 64;  // k steps of an int4 panel decoded at a time (12 KB, in L1)
// from 7 rows decoding once beats int4_tile's decode per tile (µs a row, one thread, 1-16 rows;
// fewer rows keep the tiles' side-by-side panels, which hide the FMA latency)
constexpr int64_t kDecodedFromRows = 7;

// k steps k0..k0+steps-1 of int4 (or Q4_1 grid) panel p as the float32 weights int4_tile
// computes, exactly ([steps, 48] into dst); k0 and steps are whole groups.
template <Weights W>
void decode_int4(const PanelWeight<W>& weight, int64_t p, int64_t k0, int64_t steps, float* dst) {
  const uint8_t* panel = weight.panels + p * weight.stride;
  const float* scales = weight.scales + p * weight.scale_stride;
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t g = k0 / kInt4Group; g < (k0 + steps) / kInt4Group; ++g) {
    __m512 scale[3], zero[3];
    for (int c = 0; c < 3; ++c) group_scales<W == Weights::kQ4Grid>(scales, g, c, scale[c], zero[c]);
    for (int64_t i = g * kInt4Group; i < (g + 1) * kInt4Group; i += 2) {
      const uint8_t* bytes = panel + (i / 2) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchAhead * kPanel), _MM_HINT_T0);
      float* row = dst + (i - k0) * kPanel;
      for (int c = 0; c < 3; ++c) {
        const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * c)));
        _mm512_storeu_ps(row + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(both, low)), scale[c], zero[c]));
        _mm512_storeu_ps(row + kPanel + 16 * c,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4)), scale[c], zero[c]));
      }
    }
  }
}

// k steps k0..k0+steps-1 of Q8_0 grid panel p: w = q * d, exact (float32 d per group and column).
void decode_q8(const PanelWeight<Weights::kQ8Grid>& weight, int64_t p, int64_t k0, int64_t steps, float* dst) {
  const int8_t* panel = weight.panels + p * weight.stride;
  const float* scales = weight.scales + p * weight.scale_stride;
  for (int64_t i = k0; i < k0 + steps; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (i + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    for (int c = 0; c < 3; ++c)
      _mm512_storeu_ps(dst + (i - k0) * kPanel + 16 * c,
                       _mm512_mul_ps(weights16<Weights::kQ8Grid>(panel, i, c),
                                     _mm512_loadu_ps(scales + (i / kInt4Group) * kPanel + 16 * c)));
  }
}

// R rows' 48 running sums (acc [R, 48]; zeros when first) carried over `steps` decoded k steps.
template <int R>
void chunk_tile(const float* w, int64_t steps, const float* x, int64_t ldx, float* acc, bool first) {
  __m512 a[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) a[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * kPanel + 16 * c);
  for (int64_t i = 0; i < steps; ++i) {
    const __m512 w0 = _mm512_loadu_ps(w + i * kPanel), w1 = _mm512_loadu_ps(w + i * kPanel + 16),
                 w2 = _mm512_loadu_ps(w + i * kPanel + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
      a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm512_storeu_ps(acc + r * kPanel + 16 * c, a[r][c]);
}

using ChunkTile = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);
constexpr ChunkTile kChunkTiles[kTileRows] = {chunk_tile<1>, chunk_tile<2>, chunk_tile<3>, chunk_tile<4>,
                                              chunk_tile<5>, chunk_tile<6>, chunk_tile<7>, chunk_tile<8>};
#endif

// Seven rows or more over int4, Q4_1 or Q8_0 grid panels: each panel's weights are decoded once
// per chunk of k steps (in L1) for all the tiles, where the tiles decode them again for every tile
// of 8 rows. The same operations per output: one FMA chain over the same weights, in order from zero.
template <Weights W>
bool decoded_rows(const PanelWeight<W>& weight, int64_t p0, int64_t group, const float* x, int64_t ldx, int64_t rows,
                  float* out, int64_t ldo, int64_t cols_last) {
#if defined(__AVX512F__)
  if constexpr (W == Weights::kFloat32 || W == Weights::kInt8) {
    return false;
  } else {
    if (rows < kDecodedFromRows) return false;
    thread_local std::vector<float> chunk, sums;
    chunk.resize(kChunkSteps * kPanel);
    sums.resize(rows * kPanel);
    for (int64_t p = 0; p < group; ++p) {
      for (int64_t k0 = 0; k0 < weight.k; k0 += kChunkSteps) {
        const int64_t steps = std::min(kChunkSteps, weight.k - k0);
        if constexpr (W == Weights::kQ8Grid)
          decode_q8(weight, p0 + p, k0, steps, chunk.data());
        else
          decode_int4<W>(weight, p0 + p, k0, steps, chunk.data());
        for (int64_t r = 0; r < rows; r += kTileRows) {
          const int64_t here = std::min(kTileRows, rows - r);
          kChunkTiles[here - 1](chunk.data(), steps, x + r * ldx + k0, ldx, sums.data() + r * kPanel, k0 == 0);
        }
      }
      const int64_t cols = p + 1 == group ? cols_last : kPanel;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out + r * ldo + p * kPanel, sums.data() + r * kPanel, cols * sizeof(float));
    }
    return true;
  }
#else
  return false;
#endif
}

// rows x (group consecutive panels from panel p, the last of them cols_last wide)
template <Weights W>
void panel_rows(const PanelWeight<W>& weight, int64_t p0, int64_t group, const float* x, int64_t ldx, int64_t rows,
                float* out, int64_t ldo, int64_t cols_last) {
  if (decoded_rows<W>(weight, p0, group, x, ldx, rows, out, ldo, cols_last)) return;
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int rows_here = static_cast<int>(std::min(kTileRows, rows - r));
    const int64_t together = panels_for(rows_here);
    for (int64_t p = 0; p < group;) {
      const bool wide = p + together <= group;
      const int64_t taken = wide ? together : 1;
      const int64_t cols = (p + taken == group) ? (taken - 1) * kPanel + cols_last : taken * kPanel;
      const float* scales = weight.scales == nullptr ? nullptr : weight.scales + (p0 + p) * weight.scale_stride;
      tile<W>(rows_here, wide)(weight.panels + (p0 + p) * weight.stride, weight.stride, weight.k, x + r * ldx, ldx,
                               scales, weight.scale_stride, out + r * ldo + p * kPanel, ldo, cols);
      p += taken;
    }
  }
}

// x [M, K] times the packed weight: [M, N]
template <Weights W>
torch::Tensor panels_times(const torch::Tensor& x, const PanelWeight<W>& weight) {
  const int64_t rows = x.size(0), n = weight.n, panels = weight.count;
  TORCH_CHECK(x.size(1) == weight.k, "packed weight must take K = ", x.size(1), ", it takes ", weight.k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "out_features ", n, " does not match ", panels,
              " panels");
  auto out = torch::empty({rows, n}, x.options());
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), blocks = (rows + kBlockRows - 1) / kBlockRows;
  // tasks row block by row block, each over every panel: a split never changes an output's sum
  at::parallel_for(0, blocks * panels, kMaxGroup, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
      const int64_t block = t / panels, p = t % panels, r = block * kBlockRows;
      const int64_t group = std::min({kMaxGroup, panels - p, end - t});
      panel_rows<W>(weight, p, group, xs + r * ldx, ldx, std::min(kBlockRows, rows - r), os + r * n + p * kPanel, n,
                    std::min(kPanel, n - (p + group - 1) * kPanel));
      t += group;
    }
  });
  return out;
}

template <typename T>
torch::Tensor pack(const torch::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, k, kPanel}, weight.options());
  const T* src = weight.data_ptr<T>();
  T* dst = packed.data_ptr<T>();
  const int64_t ldw = weight.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanel + c] = src[(p * kPanel + c) * ldw + i];
  });
  return packed;
}

}  // namespace

// Whether panel_tile is the AVX-512 one (the portable loop is correct but far slower than MKL).
bool panel_kernel_vectorised() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// w [N, K] (float32 or int8) as panels [ceil(N / 48), K, 48] for panel_linear / int8_panel_linear
// (zero columns past N).
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.stride(1) == 1,
              "weight must be a CPU [N, K] with a contiguous last dimension");
  if (weight.scalar_type() == torch::kChar) return pack<int8_t>(weight);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32, "weight must be float32 or int8");
  return pack<float>(weight);
}

void check_packed(const torch::Tensor& packed, torch::ScalarType type) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == type && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(2) == kPanel,
              "packed must be pack_panels' [P, K, 48] of ", type);
}

// x [M, K] times the float32 weight pack_panels packed (N = out_features), + bias: [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                           std::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  check_packed(packed, torch::kFloat32);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == out_features,
                "bias must be float32 [N]");
  const int64_t k = packed.size(1);
  auto out = panels_times<Weights::kFloat32>(
      x, {packed.data_ptr<float>(), k * kPanel, nullptr, 0, k, out_features, packed.size(0)});
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// x [M, K] times an int8 weight pack_panels packed, each output column times its scale
// (float32 [P * 48], zero past N): [M, N]. Each output is the FMA chain over the integers, then
// one product by the scale: the same operations at any row count and position.
torch::Tensor int8_panel_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features) {
  check_rows(x, "x");
  check_packed(packed, torch::kChar);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
                  scales.numel() == packed.size(0) * kPanel,
              "scales must be float32 [P * 48]");
  const int64_t k = packed.size(1);
  return panels_times<Weights::kInt8>(
      x, {packed.data_ptr<int8_t>(), k * kPanel, scales.data_ptr<float>(), kPanel, k, out_features, packed.size(0)});
}

// x [M, K] times an int4 weight packed as bytes [P, K / 2, 48] (k steps 2j and 2j + 1 of a column
// in the low and high nibble of one byte) with bf16 group scales [P, K / 32, 2, 48] (scale, zero
// point per column), w = (q - 8) * scale + zero as q * scale + (zero - 8 * scale): [M, N]. Float32 activations (torch's int4 kernel rounds
// them to bf16); the same operations at any row count and position.
// K of int4 bytes [P, K / 2, 48] with their 16-bit (scale, zero point) pairs [P, K / 32, 2, 48].
int64_t check_int4_panels(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          torch::ScalarType scale_type) {
  check_rows(x, "x");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kByte && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(2) == kPanel,
              "packed must be uint8 [P, K / 2, 48]");
  const int64_t k = 2 * packed.size(1);
  TORCH_CHECK(k % kInt4Group == 0, "int4 panels need K a multiple of ", kInt4Group);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == scale_type && scales.dim() == 4 &&
                  scales.size(0) == packed.size(0) && scales.size(1) == k / kInt4Group && scales.size(2) == 2 &&
                  scales.size(3) == kPanel,
              "scales must be ", scale_type, " [P, K / 32, 2, 48]");
  return k;
}

torch::Tensor int4_panel_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features) {
  const int64_t k = check_int4_panels(x, packed, scales, torch::kBFloat16);
  const int64_t panels = packed.size(0), groups = k / kInt4Group;
  // the tiles take the scales as a float pointer (int4's reinterpret it as the bf16 bits)
  const auto* bits = reinterpret_cast<const float*>(scales.data_ptr<at::BFloat16>());
  return panels_times<Weights::kInt4>(x, {packed.data_ptr<uint8_t>(), (k / 2) * kPanel, bits, groups * kPanel, k,
                                          out_features, panels});  // a panel's bf16 pairs: groups * 48 floats
}

// x [M, K] times a float32 weight stored as its Q4_1 grid: bytes [P, K / 2, 48] as int4's, and
// float16 (d, m) per group of 32 k steps and column [P, K / 32, 2, 48], w = q * d + m (one
// rounding: the float32 weight exactly when it lies on the grid). The float32 panels' bits.
torch::Tensor q4_grid_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features) {
  const int64_t k = check_int4_panels(x, packed, scales, torch::kHalf);
  const int64_t panels = packed.size(0), groups = k / kInt4Group;
  // the tiles take the scales as a float pointer (the grid's reinterpret it as float16 pairs)
  const auto* halves = reinterpret_cast<const float*>(scales.data_ptr<at::Half>());
  return panels_times<Weights::kQ4Grid>(x, {packed.data_ptr<uint8_t>(), (k / 2) * kPanel, halves, groups * kPanel, k,
                                            out_features, panels});
}

// x [M, K] times a float32 weight stored as its Q8_0 grid: int8 panels [P, K, 48] and float32 d per
// group of 32 k steps and column [P, K / 32, 48], w = q * d (exact). The float32 panels' bits.
torch::Tensor q8_grid_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t out_features) {
  check_rows(x, "x");
  check_packed(packed, torch::kChar);
  const int64_t k = packed.size(1), panels = packed.size(0), groups = k / kInt4Group;
  TORCH_CHECK(k % kInt4Group == 0, "Q8_0 panels need K a multiple of ", kInt4Group);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 3 &&
                  scales.size(0) == panels && scales.size(1) == groups && scales.size(2) == kPanel,
              "scales must be float32 [P, K / 32, 48]");
  return panels_times<Weights::kQ8Grid>(x, {packed.data_ptr<int8_t>(), k * kPanel, scales.data_ptr<float>(),
                                            groups * kPanel, k, out_features, panels});
}

// logits[dst[r]][t] = -inf for every token t that bitmask row words[r] bans (bit t % 32 of word
// t / 32 clear, or t past the words); a negative dst leaves its row alone.
void mask_rows(torch::Tensor logits, torch::Tensor words, torch::Tensor dst) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits must be float32 [B, V] on the CPU with a contiguous last dimension");
  TORCH_CHECK(words.scalar_type() == torch::kInt32 && words.dim() == 2 && words.is_contiguous(),
              "words must be contiguous int32 [R, W]");
  const auto rows = dst.to(torch::kInt64).contiguous();
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == words.size(0), "dst must be [R]");
  const int64_t vocab = logits.size(1), width = words.size(1), covered = std::min(vocab, 32 * width);
  const float banned = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const int64_t target = rows.data_ptr<int64_t>()[r];
    if (target < 0) continue;
    TORCH_CHECK(target < logits.size(0), "logits row ", target, " out of range");
    float* row = logits.data_ptr<float>() + target * logits.stride(0);
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>() + r * width);
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 ban = _mm512_set1_ps(banned);
    for (; t + 32 <= covered; t += 32) {  // 16 tokens per masked store: the banned bits, inverted
      const uint32_t word = bits[t >> 5];
      if (word == 0xFFFFFFFFu) continue;  // a whole word allowed (inside a string, most are)
      _mm512_mask_storeu_ps(row + t, static_cast<__mmask16>(~word & 0xFFFFu), ban);
      _mm512_mask_storeu_ps(row + t + 16, static_cast<__mmask16>(~word >> 16), ban);
    }
#endif
    for (; t < covered; t += 32) {
      const uint32_t word = bits[t >> 5];
      if (word == 0xFFFFFFFFu) continue;
      for (int64_t b = 0; b < 32 && t + b < covered; ++b)
        if (!((word >> b) & 1u)) row[t + b] = banned;
    }
    for (int64_t t = covered; t < vocab; ++t) row[t] = banned;
  }
}

// cpu_attention.cpp
void output_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_tables, torch::Tensor items, double scale);
// cpu_sampler.cpp
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor uniforms);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the kernels run without the GIL: the mask thread and the HTTP thread go on meanwhile
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("mask_rows", &mask_rows, "ban the tokens a bitmask row bans, in place", nogil);
  m.def("int4_linear", &int4_linear, "float32 rows through torch's int4 CPU kernel", nogil);
  m.def("int8_linear", &int8_linear, "float32 rows through torch's int8 CPU kernel", nogil);
  m.def("add_rmsnorm", &add_rmsnorm, "residual += x; RMSNorm(residual) * weight (float32 rows)", nogil);
  m.def("rope_write_kv", &rope_write_kv, "rotary on q and k, k and v written to their cache slots", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil);
  m.def("panel_kernel_vectorised", &panel_kernel_vectorised, "whether the AVX-512 kernels were built (panels, output attention, sampler)");
  m.def("pack_panels", &pack_panels, "a float32 or int8 weight [N, K] as K-major panels of 48 rows", nogil);
  m.def("panel_linear", &panel_linear, "float32 rows times a packed weight, each row as it would be alone", nogil);
  m.def("int4_panel_linear", &int4_panel_linear, "float32 rows times a packed int4 weight and its group scales", nogil);
  m.def("int8_panel_linear", &int8_panel_linear, "float32 rows times a packed int8 weight and its column scales", nogil);
  m.def("q4_grid_linear", &q4_grid_linear, "float32 rows times a weight stored as its Q4_1 grid (the float32 bits)", nogil);
  m.def("q8_grid_linear", &q8_grid_linear, "float32 rows times a weight stored as its Q8_0 grid (the float32 bits)", nogil);
  m.def("output_attention", &output_attention, "output queries over a paged cache, each on its own", nogil);
  m.def("sample_rows", &sample_rows, "one token per float32 logit row by inverse CDF (AVX-512)", nogil);
}
