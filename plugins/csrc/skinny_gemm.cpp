// Skinny fp32 GEMM for decode on AVX2 CPUs: y[M, N] = x[M, K] @ w[N, K]^T for small M (the decode batch).
//
// Why: for M = 1..32 and SmolLM2's shapes (K = 576 or 1536) MKL's sgemm runs at a fraction of memory bandwidth
// here (batch 1: ~2x the bandwidth floor; batch 2 costs 2.5x batch 1). Decode is bound by reading the weights,
// so the kernel reads each weight row once from memory and reuses it from L1 for every row of x: a block of
// NT weight rows times MT rows of x is accumulated in NT*MT AVX2 registers, and the weight block stays hot in
// L1 while all of x's row tiles pass over it. Threads split the output columns (torch's intra-op pool).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "cpu_tile.h"

namespace {

using morphserve_cpu::kTileN;
using morphserve_cpu::rows_times_block;

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
  const int64_t blocks = (N + kTileN - 1) / kTileN;
  // Grain: at least ~64 KB of weights per task so that thread hand-off stays negligible.
  const int64_t grain = std::max<int64_t>(1, (16384 + kTileN * K - 1) / (kTileN * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kTileN;
      const float* w = wp + n * K;
      float* yb = yp + n;
      const int64_t nt = std::min<int64_t>(kTileN, N - n);
      if (nt == kTileN) {
        rows_times_block<kTileN>(xp, M, w, K, yb, N, K);
      } else {
        for (int64_t j = 0; j < nt; ++j) rows_times_block<1>(xp, M, w + j * K, K, yb + j, N, K);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("skinny_linear(Tensor input, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("skinny_linear", skinny_linear); }
