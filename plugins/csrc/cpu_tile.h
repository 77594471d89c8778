// The fp32 register tile shared by the CPU kernels: rows of x against a block of weight rows.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace morphserve_cpu {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One MT x NT tile of y over the whole K. Each output sums its products 8 lanes at a time in increasing k,
// then adds the lanes: the same order for every MT, so a row's result does not depend on the batch.
template <int MT, int NT>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) {
      const __m256 wv = _mm256_loadu_ps(w + n * ldw + k);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * w[n * ldw + kk];
      y[m * ldy + n] = s;
    }
}

// Tile shape measured on the 2-core AVX2 machine against 2x4, 3x4 and 4x3 (fastest from batch 1 to 16):
// 12 accumulators + 2 rows of x + 1 weight load = 15 of the 16 AVX2 registers.
constexpr int kTileN = 6;  // weight rows per block
constexpr int kTileM = 2;  // rows of x per register tile

// All M rows of x [M, K] against NT weight rows w [NT, ldw]: y[m, n] at y + m * ldy + n.
template <int NT>
inline void rows_times_block(const float* x, int64_t M, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  int64_t m = 0;
  for (; m + kTileM <= M; m += kTileM) tile<kTileM, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K);
  for (; m < M; ++m) tile<1, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K);
}

}  // namespace morphserve_cpu
