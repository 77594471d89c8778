// The INT8 table's linear with int8 activations (W8A8) on AVX-512 VNNI CPUs: y[M, N] = s[n] * sum over blocks
// b of d[m, b] * (xq[m, b] . q[n, b]), x quantized per kQBlock inputs (absmax / 127, rounded to nearest even),
// q the table's int8 rows with one fp32 scale each (plugins/int8_linear.py). It serves the LM head when that
// unit is morphed to INT8.
//
// Why: with fp32 activations (int8_linear.cpp) each 8 weights cost a widen, a convert and an FMA per row, and
// at 16 decode rows the 49152 x 576 head was compute-bound at ~6.5 ms a step on this 2-core machine, a fifth
// of the step. `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and adds them in fours into 16 int32 lanes
// in one instruction, exactly. The weight bytes are made unsigned by flipping their sign bit (w + 128) and the
// surplus 128 * sum(x) is taken out by starting each block's lanes at -128 * (their 4 inputs' sum): a block's
// integer dot product is exact, converted to fp32 exactly (|sum| <= 64 * 127 * 127 < 2^24), scaled by the
// block's d with one FMA per lane, and the 16 lanes are added at the end by one fixed tree per column.
//
// The same arithmetic whatever the tile (lanes in increasing block order, then the same reduction tree for
// every column, padded with zero vectors where a tile has fewer columns): a row's result does not depend on
// its batch. Against the torch reference (reference_linear_q8) the integer sums are identical and only the
// fp32 order of the block sums differs (a few ulp).
//
// Compiled for AVX-512 through function target attributes (the rest of the library stays AVX2); the op
// refuses to run where the CPU lacks the instructions (checked at run time), and Python only calls it where
// /proc/cpuinfo lists them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "int8_checks.h"

namespace {

using morphserve_cpu::cpu_has_avx512_vnni;

constexpr int64_t kQBlock = 64;  // inputs per activation scale: one zmm of bytes (+0.10% perplexity, per row +0.75%)
constexpr int64_t kRowTile = 4;  // rows of x per tile (16 accumulators of 32 registers at 4 columns)
constexpr int64_t kColTile = 4;  // weight rows per reduction tree
constexpr int64_t kBlockCols = 8;  // weight rows per task unit: 8 streams prefetched ahead, as int8_linear.cpp
constexpr int64_t kPrefetchBlocks = 4;

// Row x [K] to int8 blocks: q [K], d [K / kQBlock], and each block's 16 lane starts -128 * (sum of the lane's
// 4 inputs) into init [K / kQBlock * 16]. Scalar on purpose: the same float ops as the torch reference
// (a / 127, 127 / a, round half to even), so both quantize bit for bit alike; M x K is small.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* init) {
  for (int64_t b = 0; b < K / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    float a = 0.f;
    // A NaN input makes the scale NaN (as torch's amax does) and so the row's outputs; its bytes are then 0.
    for (int64_t k = 0; k < kQBlock; ++k) a = std::isnan(xb[k]) || std::fabs(xb[k]) > a ? std::fabs(xb[k]) : a;
    d[b] = a / 127.f;
    const float inv = a > 0.f ? 127.f / a : 0.f;
    for (int64_t k = 0; k < kQBlock; ++k) {
      const float v = xb[k] * inv;
      q[b * kQBlock + k] = v == v ? static_cast<int8_t>(std::nearbyint(v)) : 0;
    }
    for (int64_t lane = 0; lane < 16; ++lane) {
      int32_t s = 0;
      for (int64_t j = 0; j < 4; ++j) s += q[b * kQBlock + lane * 4 + j];
      init[b * 16 + lane] = -128 * s;
    }
  }
}

// The 4 columns' lane sums, one fixed tree: halves of 512 bits added, then pairwise within 128-bit lanes.
MS_AVX512_VNNI inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

struct Quantized {
  const int8_t* q;
  const float* d;
  const int32_t* init;
  int64_t K;
};

// MT rows of x (from row m0) against NT (<= kColTile groups of 4) weight rows from w; y at y[m * ldy + n].
// `ahead`: the weight rows read kPrefetchBlocks blocks later, prefetched a line per row per block step.
template <int MT, int NT>
MS_AVX512_VNNI inline void tile(const Quantized& x, int64_t m0, const int8_t* w, int64_t nvalid, const float* scale,
                           float* y, int64_t ldy, const int8_t* ahead) {
  static_assert(NT % kColTile == 0, "columns come in groups of the reduction tree");
  const int64_t K = x.K, blocks = K / kQBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 part[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) part[m][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wv[NT];
    for (int n = 0; n < NT; ++n) {
      // Rows past the table's end (the last partial group) read as zeros: their outputs are dropped.
      wv[n] = n < nvalid ? _mm512_xor_si512(_mm512_loadu_si512(w + n * K + b * kQBlock), flip) : _mm512_setzero_si512();
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + n * K + b * kQBlock), _MM_HINT_T0);
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t r = m0 + m;
      const __m512i xv = _mm512_loadu_si512(x.q + r * K + b * kQBlock);
      const __m512i iv = _mm512_loadu_si512(x.init + (r * blocks + b) * 16);
      const __m512 dv = _mm512_set1_ps(x.d[r * blocks + b]);
      for (int n = 0; n < NT; ++n)
        part[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(iv, wv[n], xv)), dv, part[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; n += kColTile) {
      const __m128 s = reduce4(part[m][n], part[m][n + 1], part[m][n + 2], part[m][n + 3]);
      alignas(16) float out[4];
      _mm_store_ps(out, s);
      for (int j = 0; j < 4 && n + j < nvalid; ++j) y[(m0 + m) * ldy + n + j] = out[j] * scale[n + j];
    }
}

// All M rows against weight rows [n0, n0 + nt), nt <= kBlockCols.
MS_AVX512_VNNI void rows_times_block(const Quantized& x, int64_t M, const int8_t* w, int64_t nt, const float* scale,
                                float* y, int64_t ldy, const int8_t* ahead) {
  if (M == 1 && nt == kBlockCols) {
    tile<1, kBlockCols>(x, 0, w, nt, scale, y, ldy, ahead);
    return;
  }
  for (int64_t n = 0; n < nt; n += kColTile) {
    const int64_t nv = std::min(kColTile, nt - n);
    const int8_t* pre = ahead == nullptr ? nullptr : ahead + n * x.K;  // the first row tile prefetches
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile, pre = nullptr)
      tile<kRowTile, kColTile>(x, m, w + n * x.K, nv, scale + n, y + n, ldy, pre);
    switch (M - m) {
      case 3: tile<3, kColTile>(x, m, w + n * x.K, nv, scale + n, y + n, ldy, pre); break;
      case 2: tile<2, kColTile>(x, m, w + n * x.K, nv, scale + n, y + n, ldy, pre); break;
      case 1: tile<1, kColTile>(x, m, w + n * x.K, nv, scale + n, y + n, ldy, pre); break;
      default: break;
    }
  }
}

at::Tensor int8_linear_q8(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "int8_linear_q8: this CPU lacks AVX-512 VNNI (use int8_linear, fp32 activations)");
  morphserve_cpu::check_int8_linear_args("int8_linear_q8", input, weight, scales);
  TORCH_CHECK(weight.size(1) % kQBlock == 0, "int8_linear_q8: the feature count ", weight.size(1),
              " must be a multiple of ", kQBlock);
  const at::Tensor xin = input.contiguous();
  const int64_t M = xin.size(0), K = xin.size(1), N = weight.size(0), blocks = K / kQBlock;
  at::Tensor y = at::empty({M, N}, xin.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * blocks);
  std::vector<int32_t> init(M * blocks * 16);
  const float* xp = xin.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, q.data() + m * K, d.data() + m * blocks, init.data() + m * blocks * 16);
  const Quantized x{q.data(), d.data(), init.data(), K};
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t units = (N + kBlockCols - 1) / kBlockCols;
  const int64_t grain = std::max<int64_t>(1, (16384 + kBlockCols * K - 1) / (kBlockCols * K));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const int64_t full = std::min(u1, N / kBlockCols);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = u * kBlockCols, nt = std::min<int64_t>(kBlockCols, N - n);
      const int8_t* ahead = u + kPrefetchBlocks < full ? wp + (n + kPrefetchBlocks * kBlockCols) * K : nullptr;
      rows_times_block(x, M, wp + n * K, nt, sp + n, yp + n, N, ahead);
    }
  });
  return y;
}

bool int8_linear_q8_supported() { return cpu_has_avx512_vnni(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int8_linear_q8(Tensor input, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_linear_q8_supported() -> bool", int8_linear_q8_supported);  // no tensors: a catch-all kernel
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int8_linear_q8", int8_linear_q8); }
