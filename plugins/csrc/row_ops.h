// A decoder layer's row-wise arithmetic on one row, shared by the per-op kernels (layer_elementwise.cpp) and the
// fused decode layer (decode_layer.cpp): one definition, so both give bitwise the same rows.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "avx2_math.h"
#include "cpu_tile.h"

namespace morphserve_cpu {

// out = x / sqrt(mean(x^2) + eps) * w (HF Llama's RMSNorm, all in fp32).
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t j = k; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (k = 0; k + 8 <= n; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv), _mm256_loadu_ps(w + k)));
  for (int64_t j = k; j < n; ++j) out[j] = x[j] * inv * w[j];
}

// out = a + b (the residual add: the same IEEE sums as torch's add).
inline void add_row(const float* a, const float* b, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, _mm256_add_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k)));
  for (; k < n; ++k) out[k] = a[k] + b[k];
}

// One row of gate | up [2I] -> silu(gate) * up [I], silu(g) = g / (1 + e^-g).
inline void silu_mul_row(const float* g, float* o, int64_t I) {
  const float* u = g + I;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= I; k += 8) {
    const __m256 gv = _mm256_loadu_ps(g + k);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
  }
  for (; k < I; ++k) o[k] = g[k] / (1.f + std::exp(-g[k])) * u[k];
}

}  // namespace morphserve_cpu
