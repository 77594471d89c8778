// INT4 weight-only linear on AVX2 CPUs with fp32 activations: y[M, N] = x[M, K] @ W[N, K]^T, where
// W = q * s + (z - 8 s) per group of G inputs (the portable fragment format of plugins/quant_matmul.py:
// nibbles [N, K/2], element 2i in the high nibble; scales/zeros bf16, here re-laid as [N, K/G, 2]).
//
// Why: torch's CPU int4 kernel needs bf16 activations (its fp32 path is 3-14x slower) and at prefill sizes it
// is 1.6-2.4x slower than fp32 MKL, so a swapped layer slowed exactly the prefills that arrive under load.
// - One or two rows (decode at low load): the nibbles are unpacked in registers and never stored; the layer
//   reads 4.5 bits per weight instead of 32.
// - Up to `max_skinny_rows` rows: each block of weight rows is dequantized once into an L1-sized buffer and
//   the fp32 register tile of cpu_tile.h runs every row of x over it (unpacking per row tile costs more).
// - More rows (prefill chunks): the weight is dequantized to a transient fp32 matrix and MKL does the GEMM.
// All three use the same fp32 weight values; the first two also sum in the same order, so up to
// `max_skinny_rows` a row's result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu_tile.h"

namespace {

using morphserve_cpu::hsum;
using morphserve_cpu::kTileN;
using morphserve_cpu::rows_times_rows;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 weights (8 bytes) as two fp32 vectors in the lane order of `permute16`: lo = k {0-3, 8-11}, hi = k {4-7, 12-15}.
inline void unpack16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_srli_epi32(b, 4), l = _mm256_and_si256(b, _mm256_set1_epi32(0xF));
  lo = _mm256_cvtepi32_ps(_mm256_unpacklo_epi32(h, l));
  hi = _mm256_cvtepi32_ps(_mm256_unpackhi_epi32(h, l));
}

// x's 16-element chunks reordered to match unpack16, so the weights need no cross-lane shuffle.
void permute16(const float* x, float* out, int64_t K) {
  static constexpr int kOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int64_t c = 0; c < K; c += 16)
    for (int i = 0; i < 16; ++i) out[c + i] = x[c + kOrder[i]];
}

constexpr int kNibbleN = 4;     // weight rows per block of the in-register path
constexpr int kNibbleRows = 2;  // rows of x up to which the weights are unpacked in registers

// Scale s and offset c = zero - 8 s of group g of a weight row (sz: that row's [K/G, 2] bf16 pairs).
inline void group_affine(const uint16_t* sz, int64_t g, float& s, float& c) {
  s = bf16_to_float(sz[g * 2]);
  c = bf16_to_float(sz[g * 2 + 1]) - 8.f * s;
}

// MT (<= kNibbleRows) rows of permuted x against NT weight rows, unpacked in registers.
template <int MT, int NT>
inline void nibble_tile(const float* xp, int64_t K, const uint8_t* q, const uint16_t* sz, int64_t G, float* y, int64_t ldy) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NT], c[NT];
    for (int n = 0; n < NT; ++n) {
      float sc, off;
      group_affine(sz + n * groups * 2, g, sc, off);
      s[n] = _mm256_set1_ps(sc);
      c[n] = _mm256_set1_ps(off);
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      for (int n = 0; n < NT; ++n) {
        __m256 wl, wh;
        unpack16(q + n * (K / 2) + k / 2, wl, wh);
        wl = _mm256_fmadd_ps(wl, s[n], c[n]);
        wh = _mm256_fmadd_ps(wh, s[n], c[n]);
        for (int m = 0; m < MT; ++m) {
          acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + m * K + k), wl, acc[m][n]);
          acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + m * K + k + 8), wh, acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) y[m * ldy + n] = hsum(acc[m][n]);
}

template <int NT>
inline void nibble_block(const float* xp, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz, int64_t G,
                         float* y, int64_t N) {
  if (M == 2) nibble_tile<2, NT>(xp, K, q, sz, G, y, N);
  else nibble_tile<1, NT>(xp, K, q, sz, G, y, N);
}

// Rows of the weight as fp32 in permute16's order (what nibble_tile computes in registers).
void dequantize_permuted(const uint8_t* q, const uint16_t* sz, int64_t G, int64_t K, int64_t rows, float* out) {
  const int64_t groups = K / G;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t g = 0; g < groups; ++g) {
      float sc, off;
      group_affine(sz + n * groups * 2, g, sc, off);
      const __m256 s = _mm256_set1_ps(sc), c = _mm256_set1_ps(off);
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        __m256 lo, hi;
        unpack16(q + n * (K / 2) + k / 2, lo, hi);
        _mm256_storeu_ps(out + n * K + k, _mm256_fmadd_ps(lo, s, c));
        _mm256_storeu_ps(out + n * K + k + 8, _mm256_fmadd_ps(hi, s, c));
      }
    }
}

void check(const at::Tensor& qweight, const at::Tensor& sz, int64_t G, int64_t K) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "int4_linear: contiguous uint8 qweight [N, K/2] expected");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(G > 0 && G % 16 == 0 && K % G == 0, "int4_linear: group size ", G,
              " must be a multiple of 16 that divides K = ", K);
  TORCH_CHECK(qweight.size(1) * 2 == K, "int4_linear: input has ", K, " features, weight expects ", qweight.size(1) * 2);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == N &&
                  sz.size(1) == K / G && sz.size(2) == 2,
              "int4_linear: contiguous bf16 scales_zeros [N, K/G, 2] = [", N, ", ", K / G, ", 2] expected");
}

// The fp32 weight [N, K] the kernels compute with, in natural order, into `out`.
void dequantize_into(const at::Tensor& qweight, const at::Tensor& sz, int64_t G, float* out) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, groups = K / G;
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        float sc, c;
        group_affine(s + n * groups * 2, g, sc, c);
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
          const uint8_t b = q[n * (K / 2) + k / 2];
          out[n * K + k] = std::fma(static_cast<float>(b >> 4), sc, c);
          out[n * K + k + 1] = std::fma(static_cast<float>(b & 0xF), sc, c);
        }
      }
  });
}

at::Tensor int4_dequantize(const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  check(qweight, sz, G, qweight.size(1) * 2);
  at::Tensor w = at::empty({qweight.size(0), qweight.size(1) * 2}, at::kFloat);
  dequantize_into(qweight, sz, G, w.data_ptr<float>());
  return w;
}

// Prefill-sized input: dequantize into a per-thread scratch (kept: a fresh multi-MB tensor per call would be
// mapped and faulted in anew each time) and let MKL multiply.
at::Tensor dequantized_linear(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  thread_local std::vector<float> scratch;
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  if (static_cast<int64_t>(scratch.size()) < N * K) scratch.resize(N * K);
  dequantize_into(qweight, sz, G, scratch.data());
  return at::linear(input, at::from_blob(scratch.data(), {N, K}, at::kFloat));
}

at::Tensor int4_linear(const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& sz, int64_t G,
                       int64_t max_skinny_rows) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2, "int4_linear: fp32 input [M, K] expected");
  const int64_t M = input.size(0), K = input.size(1);
  check(qweight, sz, G, K);
  if (M > max_skinny_rows) return dequantized_linear(input, qweight, sz, G);
  const int64_t N = qweight.size(0);
  at::Tensor xp = at::empty({M, K}, at::kFloat);
  const at::Tensor x = input.contiguous();
  for (int64_t m = 0; m < M; ++m) permute16(x.data_ptr<float>() + m * K, xp.data_ptr<float>() + m * K, K);
  at::Tensor y = at::empty({M, N}, at::kFloat);
  if (M == 0 || N == 0) return y;
  const float* xpp = xp.data_ptr<float>();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / G;
  if (M <= kNibbleRows) {
    const int64_t blocks = (N + kNibbleN - 1) / kNibbleN;
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kNibbleN, nt = std::min<int64_t>(kNibbleN, N - n);
        const uint8_t* qb = q + n * (K / 2);
        const uint16_t* sb = s + n * groups * 2;
        if (nt == kNibbleN) {
          nibble_block<kNibbleN>(xpp, M, K, qb, sb, G, yp + n, N);
        } else {
          for (int64_t j = 0; j < nt; ++j) nibble_block<1>(xpp, M, K, qb + j * (K / 2), sb + j * groups * 2, G, yp + n + j, N);
        }
      }
    });
    return y;
  }
  const int64_t blocks = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(kTileN * K);  // one dequantized weight block, reused by every row of x
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kTileN, nt = std::min<int64_t>(kTileN, N - n);
      dequantize_permuted(q + n * (K / 2), s + n * groups * 2, G, K, nt, w.data());
      rows_times_rows(xpp, M, w.data(), K, yp + n, N, nt);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_linear(Tensor input, Tensor qweight, Tensor scales_zeros, int group_size, int max_skinny_rows) -> Tensor");
  m.def("int4_dequantize(Tensor qweight, Tensor scales_zeros, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int4_dequantize", int4_dequantize);
}
