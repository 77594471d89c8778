// The fp32 register tile shared by the CPU kernels: rows of x against a block of weight rows.
#pragma once
#include <immintrin.h>

#include "cpu_features.h"

#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace morphserve_cpu {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weights are fp32, or fp16 widened to fp32 on load (F16C): the arithmetic is the same fp32 either way.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
// int8 (the INT8 LM head table, int8_linear.cpp) widens to fp32 exactly; its row scale is applied after the sum.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float load1(const int8_t* p) { return static_cast<float>(*p); }

// Process-wide: whether the dense kernels prefetch the weight rows they will read next (dense_prefetch op: A/B
// measurements; the results are the same bits either way). The lines go into L2 (T1): into L1 (T0) one core
// streamed fp16 rows from memory at ~12 GB/s against ~23, and the INT8 table's at ~20 against ~40; a
// full-precision fp16 batch-1 step took 12.4-13.5 ms with T0, 9.9-11.0 with T1 (builds alternating, 2 threads).
// Read once per block (block_ahead), not in the tiles' loops: a load there cost the 4-row tiles their registers.
inline std::atomic<int> use_dense_prefetch{1};

inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// One MT x NT tile of y over the whole K. Each output sums its products 8 lanes at a time in increasing k,
// then adds the lanes: the same order for every MT, so a row's result does not depend on the batch.
// `ahead` (or null): NT weight rows read later, prefetched a cache line per row as this tile passes the same
// offset (prefetch_line; dense_blocks passes them, and int8_linear.cpp for the INT8 head table).
template <int MT, int NT, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t K,
                 const W* ahead = nullptr) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (ahead != nullptr && k % kLine == 0) {
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) prefetch_line(ahead + n * ldw + k);
    }
    __m256 xv[MT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) {
      const __m256 wv = load8(w + n * ldw + k);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      // An explicit fma: whether the compiler contracts a*b+c must not depend on the weight type.
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * ldx + kk], load1(w + n * ldw + kk), s);
      y[m * ldy + n] = s;
    }
}

// Tile shape measured on the 2-core AVX2 machine against 2x4, 3x4 and 4x3 (fastest from batch 1 to 16):
// 12 accumulators + 2 rows of x + 1 weight load = 15 of the 16 AVX2 registers.
constexpr int kTileN = 6;  // weight rows per block
constexpr int kTileM = 2;  // rows of x per register tile

// Rows of x per register tile where AVX-512VL gives the compiler 32 ymm registers: 24 accumulators + 4 rows of
// x + 1 weight load. Each weight vector loaded then feeds 4 FMAs instead of 2.
constexpr int kWideTileM = 4;
// Process-wide: whether the dense kernels take the 4-row tiles where the CPU has AVX-512VL (dense_wide_tile op:
// A/B measurements; the results are the same bits either way).
inline std::atomic<int> use_wide_tile{1};

// The same row loop for weights already in fp32 (fp32 storage, or fp16 widened into a buffer) from
// kWideTileM rows on: the tiles are inlined into this AVX-512VL function, so they get its registers. The
// per-output arithmetic is the tile's (8 lanes, increasing k): results are bitwise those of the AVX2 loop.
template <int NT>
MS_AVX512VL_FLAT void rows_times_block_wide(const float* x, int64_t M, const float* w, int64_t ldw, float* y,
                                            int64_t ldy, int64_t K, const float* ahead) {
  int64_t m = 0;
  for (; m + kWideTileM <= M; m += kWideTileM, ahead = nullptr)
    tile<kWideTileM, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K, ahead);
  for (; m + kTileM <= M; m += kTileM) tile<kTileM, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K);
  for (; m < M; ++m) tile<1, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K);
}

// All M rows of x [M, K] against NT weight rows w [NT, ldw]: y[m, n] at y + m * ldy + n. The first row tile
// prefetches `ahead` (see tile); the others find the block in L1.
template <int NT, typename W>
inline void rows_times_block(const float* x, int64_t M, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t K,
                             const W* ahead = nullptr) {
  if constexpr (sizeof(W) == sizeof(float)) {
    if (M >= kWideTileM && use_wide_tile.load(std::memory_order_relaxed) && cpu_has_avx512_vl()) return rows_times_block_wide<NT>(x, M, w, ldw, y, ldy, K, ahead);
  }
  int64_t m = 0;
  for (; m + kTileM <= M; m += kTileM, ahead = nullptr) tile<kTileM, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K, ahead);
  for (; m < M; ++m, ahead = nullptr) tile<1, NT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K, ahead);
}

// All M rows of x against the nt (<= kTileN) weight rows at w [nt, K]: a full block through the register tile,
// a tail block row by row. `ahead`: a full block to prefetch, or null.
template <typename W>
inline void rows_times_rows(const float* x, int64_t M, const W* w, int64_t K, float* y, int64_t ldy, int64_t nt,
                            const W* ahead = nullptr) {
  if (nt == kTileN) {
    rows_times_block<kTileN>(x, M, w, K, y, ldy, K, ahead);
  } else {
    for (int64_t j = 0; j < nt; ++j) rows_times_block<1>(x, M, w + j * K, K, y + j, ldy, K);
  }
}

// Rows of x up to which fp16 weights are widened in registers rather than once into a buffer.
constexpr int64_t kInRegisterRows = 2;
// Blocks of weight rows ahead of the one being read that dense_blocks prefetches (see tile and widen): the
// block's kTileN short row streams, read side by side, kept too few lines in flight for the hardware
// prefetcher alone.
constexpr int64_t kPrefetchBlocks = 4;

// The block kPrefetchBlocks on from block b (of `full` whole blocks of `rows` weight rows of K), or null past
// the end or with prefetch off.
template <typename W>
inline const W* block_ahead(const W* w, int64_t b, int64_t full, int64_t K, int64_t rows = kTileN) {
  if (b + kPrefetchBlocks >= full || !use_dense_prefetch.load(std::memory_order_relaxed)) return nullptr;
  return w + (b + kPrefetchBlocks) * rows * K;
}

inline int64_t num_blocks(int64_t N) { return (N + kTileN - 1) / kTileN; }

inline void widen(const uint16_t* w, int64_t n, float* out, const uint16_t* ahead = nullptr) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (ahead != nullptr && i % 32 == 0) prefetch_line(ahead + i);
    _mm256_storeu_ps(out + i, load8(w + i));
  }
  for (; i < n; ++i) out[i] = load1(w + i);
}

// Blocks [b0, b1) of kTileN output columns of y [M, N] = x [M, K] @ w [N, K]^T: the skinny GEMM's whole work
// for one thread (skinny_gemm.cpp and the fused decode layer both run it). fp32 weights go straight through
// the register tile; fp16 weights are widened in registers for up to kInRegisterRows rows, beyond that once
// per block into `wide` (this thread's buffer, grown here), so every row sees the same fp32 values and sums.
inline void dense_blocks(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N, int64_t b0,
                         int64_t b1, std::vector<float>&) {
  const int64_t full = std::min(b1, N / kTileN);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * kTileN;
    rows_times_rows(x, M, w + n * K, K, y + n, N, std::min<int64_t>(kTileN, N - n), block_ahead(w, b, full, K));
  }
}

inline void dense_blocks(const float* x, int64_t M, const uint16_t* w, int64_t K, float* y, int64_t N, int64_t b0,
                         int64_t b1, std::vector<float>& wide) {
  if (M > kInRegisterRows && static_cast<int64_t>(wide.size()) < kTileN * K) wide.resize(kTileN * K);
  const int64_t full = std::min(b1, N / kTileN);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * kTileN, nt = std::min<int64_t>(kTileN, N - n);
    const uint16_t* ahead = block_ahead(w, b, full, K);
    if (M <= kInRegisterRows) {
      rows_times_rows(x, M, w + n * K, K, y + n, N, nt, ahead);
    } else {
      widen(w + n * K, nt * K, wide.data(), ahead);
      rows_times_rows(x, M, wide.data(), K, y + n, N, nt);
    }
  }
}

}  // namespace morphserve_cpu
