// Structured outputs: apply allowed-token bitmasks to fp32 logits in place, on AVX2 CPUs. Bit t of a row's
// int32 words (word t / 32, bit t % 32, llguidance's layout) clear -> logit t becomes -inf; set -> unchanged.
//
// Why: unpacking the bits into a [rows, vocab] bool tensor and masked_fill_ allocate and walk two large temporaries
// per step; this reads the words once and writes only the forbidden logits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace {

void mask_row(float* x, const uint32_t* w, int64_t vocab) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m256 vninf = _mm256_set1_ps(ninf);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const int64_t full = vocab / 32;
  for (int64_t k = 0; k < full; ++k) {
    const uint32_t m = w[k];
    if (m == 0xFFFFFFFFu) continue;  // all allowed (inside strings, most words)
    float* p = x + 32 * k;
    for (int q = 0; q < 4; ++q) {
      const uint32_t b = (m >> (8 * q)) & 0xFFu;
      if (b == 0xFFu) continue;
      if (b == 0u) {
        _mm256_storeu_ps(p + 8 * q, vninf);
        continue;
      }
      const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(b)), lane_bit);
      const __m256 allowed = _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, lane_bit));
      _mm256_storeu_ps(p + 8 * q, _mm256_blendv_ps(vninf, _mm256_loadu_ps(p + 8 * q), allowed));
    }
  }
  for (int64_t t = 32 * full; t < vocab; ++t)
    if (!((w[t / 32] >> (t % 32)) & 1u)) x[t] = ninf;
}

// logits [B, vocab] fp32 contiguous; bitmask [M, words] int32 contiguous with words * 32 >= vocab; rows [M] int64:
// bitmask row i masks logits row rows[i].
void apply_token_bitmask_(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "apply_token_bitmask_: logits must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be a contiguous 2-D int32 CPU tensor");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  rows.size(0) == bitmask.size(0),
              "apply_token_bitmask_: rows must be int64 [bitmask rows]");
  const int64_t B = logits.size(0), vocab = logits.size(1), words = bitmask.size(1), M = rows.size(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask_: ", words, " words cannot cover a vocabulary of ", vocab);
  const at::Tensor r = rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < B, "apply_token_bitmask_: row ", rp[i], " out of range [0, ", B, ")");
  float* xp = logits.data_ptr<float>();
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(vocab, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) mask_row(xp + rp[i] * vocab, wp + i * words, vocab);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("apply_token_bitmask_", apply_token_bitmask_); }
