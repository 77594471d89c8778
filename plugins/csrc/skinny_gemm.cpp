// Skinny fp32 GEMM for decode on AVX2 CPUs: y[M, N] = x[M, K] @ w[N, K]^T for small M (the decode batch).
//
// Why: for M = 1..32 and SmolLM2's shapes (K = 576 or 1536) MKL's sgemm runs at a fraction of memory bandwidth
// here (batch 1: ~2x the bandwidth floor; batch 2 costs 2.5x batch 1). Decode is bound by reading the weights,
// so the kernel reads each weight row once from memory and reuses it from L1 for every row of x: a block of
// NT weight rows times MT rows of x is accumulated in NT*MT AVX2 registers, and the weight block stays hot in
// L1 while all of x's row tiles pass over it. Threads split the output columns (torch's intra-op pool).
// Every output element is summed in the same order whatever M is, so a row's result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One MT x NT tile of y over the whole K.
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
constexpr int kNT = 6;  // weight rows per block
constexpr int kMT = 2;  // rows of x per register tile

// All rows of x against weight rows [n, n + nt), nt <= kNT.
template <int NT>
inline void column_block(const float* x, int64_t M, const float* w, float* y, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + kMT <= M; m += kMT) tile<kMT, NT>(x + m * K, K, w, K, y + m * N, N, K);
  for (; m < M; ++m) tile<1, NT>(x + m * K, K, w, K, y + m * N, N, K);
}

at::Tensor skinny_linear(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: fp32 input and weight expected, got ", input.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors expected");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "skinny_linear: contiguous 2-D weight [N, K] expected");
  TORCH_CHECK(input.dim() == 2, "skinny_linear: 2-D input [M, K] expected, got ", input.dim(), " dims");
  TORCH_CHECK(input.size(1) == weight.size(1), "skinny_linear: input has ", input.size(1),
              " features, weight expects ", weight.size(1));
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kNT - 1) / kNT;
  // Grain: at least ~64 KB of weights per task so that thread hand-off stays negligible.
  const int64_t grain = std::max<int64_t>(1, (16384 + kNT * K - 1) / (kNT * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kNT;
      const float* w = wp + n * K;
      float* yb = yp + n;
      const int64_t nt = std::min<int64_t>(kNT, N - n);
      if (nt == kNT) {
        column_block<kNT>(xp, M, w, yb, N, K);
      } else {
        for (int64_t j = 0; j < nt; ++j) column_block<1>(xp, M, w + j * K, yb + j, N, K);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("skinny_linear(Tensor input, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("skinny_linear", skinny_linear); }
