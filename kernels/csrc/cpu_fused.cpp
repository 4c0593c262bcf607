// Small CPU ops fused into one call each (kernels/cpu_fused.py builds this): a decoder layer's
// float32 norms, rotary and activation, the quantized projections' casts, the sampler's bitmask.
//
// At one decode row the CPU step is bound by dispatch, not arithmetic: the torch references of
// these ops are 6-12 aten calls of a few microseconds each over a 576-wide row (the bitmask's
// expands every bit to an int32 first). Each function here does a whole row in one call, row by
// row (a row's result never depends on the others, so drafts and batching keep their outputs).
// Built with -ffp-contract=off: the rotary's products and sum round as the reference's separate
// ops do, bit for bit.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

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
    for (int64_t t = 0; t < covered; t += 32) {
      const uint32_t word = bits[t >> 5];
      if (word == 0xFFFFFFFFu) continue;  // a whole word allowed (inside a string, most are)
      for (int64_t b = 0; b < 32 && t + b < covered; ++b)
        if (!((word >> b) & 1u)) row[t + b] = banned;
    }
    for (int64_t t = covered; t < vocab; ++t) row[t] = banned;
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_rows", &mask_rows, "ban the tokens a bitmask row bans, in place");
  m.def("int4_linear", &int4_linear, "float32 rows through torch's int4 CPU kernel");
  m.def("int8_linear", &int8_linear, "float32 rows through torch's int8 CPU kernel");
  m.def("add_rmsnorm", &add_rmsnorm, "residual += x; RMSNorm(residual) * weight (float32 rows)");
  m.def("rope_write_kv", &rope_write_kv, "rotary on q and k, k and v written to their cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
