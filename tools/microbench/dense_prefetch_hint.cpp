// Synthetic one-row fp16 dense pass: which cache level the software prefetch fills decides how fast a core
// streams the weights from memory.
//
// The dense kernel (plugins/csrc/cpu_tile.h) reads a block of 6 weight rows side by side, 8 fp16 weights of
// each row per step, widened to fp32 (F16C) into one FMA per row. With the rows in cache one core runs that
// loop at ~43 GB/s; from memory it ran at ~12 GB/s while a plain sum streamed ~30. This loop is the same inner
// work over 207 MB of weights (far beyond the L3), row-major as the engine stores them, with the rows 4
// blocks ahead prefetched a cache line per row:
//   - not at all (the hardware prefetcher alone),
//   - into L1 (prefetcht0, the kernel before 2026-12-05), into L2 (prefetcht1, the kernel since), into L3 (prefetcht2),
// and, as the bound of what one sequential stream reaches, the same blocks repacked so that a block's 6 rows
// sit interleaved 8 weights at a time (no prefetch). Medians of 12 passes, on 1 and 2 threads.
// Not part of the build: g++ -O3 -mavx2 -mfma -mf16c -fopenmp -o /tmp/dense_prefetch_hint
// tools/microbench/dense_prefetch_hint.cpp && OMP_WAIT_POLICY=ACTIVE /tmp/dense_prefetch_hint
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int NT = 6;  // weight rows per block (cpu_tile.h's kTileN)
constexpr int64_t K = 576, BLOCKS = 30000, N = NT * BLOCKS;
constexpr int kAhead = 4;  // blocks ahead (cpu_tile.h's kPrefetchBlocks)

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// HINT: -1 no prefetch, else the _mm_hint (3 = T0, 2 = T1, 1 = T2).
template <int HINT>
void row_major(const float* x, const uint16_t* w, float* y, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* wb = w + b * NT * K;
    const uint16_t* ahead = b + kAhead < b1 ? wb + kAhead * NT * K : nullptr;
    __m256 acc[NT];
    for (int n = 0; n < NT; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      if (HINT >= 0 && ahead != nullptr && k % 32 == 0)
        for (int n = 0; n < NT; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + n * K + k), static_cast<_mm_hint>(HINT < 0 ? 0 : HINT));
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int n = 0; n < NT; ++n) acc[n] = _mm256_fmadd_ps(xv, load8(wb + n * K + k), acc[n]);
    }
    for (int n = 0; n < NT; ++n) y[b * NT + n] = hsum(acc[n]);
  }
}

// The block's rows interleaved 8 weights at a time: one sequential stream.
void interleaved(const float* x, const uint16_t* w, float* y, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* wb = w + b * NT * K;
    __m256 acc[NT];
    for (int n = 0; n < NT; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int n = 0; n < NT; ++n) acc[n] = _mm256_fmadd_ps(xv, load8(wb + k * NT + n * 8), acc[n]);
    }
    for (int n = 0; n < NT; ++n) y[b * NT + n] = hsum(acc[n]);
  }
}

using Pass = void (*)(const float*, const uint16_t*, float*, int64_t, int64_t);

static double gbps(Pass pass, const float* x, const uint16_t* w, float* y, int threads) {
  std::vector<double> t;
  for (int r = 0; r < 12; ++r) {
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
      const int i = omp_get_thread_num(), n = omp_get_num_threads();
      pass(x, w, y, BLOCKS * i / n, BLOCKS * (i + 1) / n);
    }
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return N * K * 2 / t[t.size() / 2] / 1e9;
}

static double sum_gbps(const float* a, int64_t n, int threads) {
  std::vector<double> t;
  volatile float sink = 0;
  for (int r = 0; r < 7; ++r) {
    const double t0 = now();
    float s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(threads)
    for (int64_t i = 0; i < n; i += 16) s += hsum(_mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(a + i + 8)));
    sink = s;
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return n * 4 / t[t.size() / 2] / 1e9;
}

int main() {
  std::vector<uint16_t> w(N * K);
  for (int64_t i = 0; i < N * K; ++i) w[i] = _cvtss_sh(static_cast<float>(i % 97) / 97.f, 0);
  std::vector<float> x(K, 0.5f), y(N);
  std::vector<float> plain(int64_t(64) << 20, 1.f);  // 256 MB for the plain streaming sum
  std::printf("one-row fp16 dense pass, %.0f MB of weights in blocks of %d rows x %lld, prefetch %d blocks ahead (GB/s)\n",
              N * K * 2 / 1e6, NT, static_cast<long long>(K), kAhead);
  for (int threads = 1; threads <= 2; ++threads) {
    std::printf("threads %d: plain sum %.1f | no prefetch %.1f | into L1 (T0) %.1f | into L2 (T1) %.1f | into L3 (T2) %.1f"
                " | rows interleaved, no prefetch %.1f\n",
                threads, sum_gbps(plain.data(), plain.size(), threads),
                gbps(row_major<-1>, x.data(), w.data(), y.data(), threads),
                gbps(row_major<3>, x.data(), w.data(), y.data(), threads),
                gbps(row_major<2>, x.data(), w.data(), y.data(), threads),
                gbps(row_major<1>, x.data(), w.data(), y.data(), threads),
                gbps(interleaved, x.data(), w.data(), y.data(), threads));
  }
}
