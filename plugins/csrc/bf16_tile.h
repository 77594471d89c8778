// The bf16 register tile (AVX512_BF16): rows of x rounded to bf16 against a block of bf16 weight rows, fp32 sums.
// Shared by bf16_linear.cpp (the per-op kernel) and decode_layer.cpp (the fused decode step), so both give the
// same bits. Each output sums its products 32 inputs at a time (16 lanes of pairs) in increasing k, the last
// step masked past K, then adds the lanes: the same order for every M, so a row's result does not depend on the batch. A block of
// kWeightRows weight rows stays in L1 while every row tile of x passes over it; the block kPrefetchBlocks on is
// prefetched a line per row per step (as the fp32 tiles do). Call only where cpu_has_avx512_bf16().
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"
#include "cpu_tile.h"

namespace morphserve_cpu::bf16 {

constexpr int64_t kStep = 32;  // bf16 inputs per dot-product instruction (a 64-byte line)
constexpr int kRowsPerTile = 4;
constexpr int kWeightRows = 6;  // 24 accumulators + 4 rows of x + 1 weight load of the 32 zmm registers

MS_AVX512_BF16 inline __m512bh load_bf16(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
MS_AVX512_BF16 inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// fp32 rows -> bf16 bits, rounded to nearest even.
MS_AVX512_BF16 inline void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i))));
  }
}

// One step of 32 inputs at k for MT rows of x against NT weight rows; `mask` selects the inputs past K as zero
// (the last step when K is not a multiple of 32), so a tail adds exact zeros.
template <int MT, int NT, bool Tail>
MS_AVX512_BF16 inline void step(__m512 (&acc)[MT][NT], const uint16_t* x, const uint16_t* w, int64_t K, int64_t k,
                                __mmask32 mask) {
  __m512bh xv[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) xv[m] = Tail ? load_bf16(x + m * K + k, mask) : load_bf16(x + m * K + k);
#pragma GCC unroll 8
  for (int n = 0; n < NT; ++n) {
    const __m512bh wv = Tail ? load_bf16(w + n * K + k, mask) : load_bf16(w + n * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
  }
}

// MT rows of x (bf16, row stride K) against NT weight rows (bf16, row stride K): y[m * ldy + n].
template <int MT, int NT>
MS_AVX512_BF16 inline void tile(const uint16_t* x, const uint16_t* w, float* y, int64_t ldy, int64_t K,
                                const uint16_t* ahead) {
  __m512 acc[MT][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t k = 0;
  // Whole steps with plain loads (masked ones streamed ~10% slower from memory at one row), then the tail.
  for (; k + kStep <= K; k += kStep) {
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) prefetch_line(ahead + n * K + k);
    }
    step<MT, NT, false>(acc, x, w, K, k, 0);
  }
  if (k < K) step<MT, NT, true>(acc, x, w, K, k, static_cast<__mmask32>((1ull << (K - k)) - 1));
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]);
}

// Every row of x against NT weight rows; the first row tile prefetches `ahead`, the others find the block in L1.
template <int NT>
MS_AVX512_BF16 __attribute__((flatten)) inline void rows_times_block(const uint16_t* x, int64_t M, const uint16_t* w,
                                                              float* y, int64_t ldy, int64_t K,
                                                              const uint16_t* ahead) {
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile, ahead = nullptr)
    tile<kRowsPerTile, NT>(x + m * K, w, y + m * ldy, ldy, K, ahead);
  for (; m + 2 <= M; m += 2, ahead = nullptr) tile<2, NT>(x + m * K, w, y + m * ldy, ldy, K, ahead);
  for (; m < M; ++m, ahead = nullptr) tile<1, NT>(x + m * K, w, y + m * ldy, ldy, K, ahead);
}

// Blocks [b0, b1) of kWeightRows output columns of y [M, N] = x [M, K] @ w [N, K]^T, x already in bf16
// (round_to_bf16): one thread's share of the work.
MS_AVX512_BF16 inline void bf16_blocks(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, float* y, int64_t N, int64_t b0,
                        int64_t b1) {
  const int64_t full = N / kWeightRows;
  const bool prefetch = use_dense_prefetch.load(std::memory_order_relaxed);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * kWeightRows;
    const uint16_t* wb = w + n * K;
    if (n + kWeightRows <= N) {
      const uint16_t* ahead = prefetch && b + kPrefetchBlocks < full ? wb + kPrefetchBlocks * kWeightRows * K : nullptr;
      rows_times_block<kWeightRows>(x, M, wb, y + n, N, K, ahead);
    } else {
      for (int64_t j = 0; j < N - n; ++j) rows_times_block<1>(x, M, wb + j * K, y + n + j, N, K, nullptr);
    }
  }
}

inline int64_t num_blocks(int64_t N) { return (N + kWeightRows - 1) / kWeightRows; }

}  // namespace morphserve_cpu::bf16
