// Skinny GEMM for decode on AVX2 CPUs: y[M, N] = x[M, K] @ w[N, K]^T for small M (the decode batch), fp32
// activations and fp32 or fp16 weights (fp16 is widened to fp32 as it is loaded; the arithmetic is fp32).
//
// Why: for M = 1..32 and SmolLM2's shapes (K = 576 or 1536) MKL's sgemm runs at a fraction of memory bandwidth
// here (batch 1: ~2x the bandwidth floor; batch 2 costs 2.5x batch 1). Decode is bound by reading the weights,
// so the kernel reads each weight row once from memory and reuses it from L1 for every row of x: a block of
// NT weight rows times MT rows of x is accumulated in NT*MT AVX2 registers, and the weight block stays hot in
// L1 while all of x's row tiles pass over it. Threads split the output columns (torch's intra-op pool).
// fp16 weights halve the bytes a decode step reads. For one or two rows they are widened in registers; for
// more, each block is widened once into an L1 buffer that every row tile then reads, so a row's result is
// bitwise the same as with the fp32 copy of the weights, whatever the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu_tile.h"

namespace {

using morphserve_cpu::kTileN;
using morphserve_cpu::load1;
using morphserve_cpu::load8;
using morphserve_cpu::rows_times_rows;

// Rows of x up to which fp16 weights are widened in registers rather than once into a buffer.
constexpr int64_t kInRegisterRows = 2;
// Blocks of fp16 weight rows ahead of the one being read that the in-register path prefetches (tile in
// cpu_tile.h). fp16 rows are half as long, and the hardware prefetcher alone kept too few lines in flight;
// for fp32 rows the same prefetch measured no gain and is not used.
constexpr int64_t kPrefetchBlocks = 4;

void widen(const uint16_t* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(w + i));
  for (; i < n; ++i) out[i] = load1(w + i);
}

at::Tensor skinny_linear(const at::Tensor& input, const at::Tensor& weight) {
  const bool half = weight.scalar_type() == at::kHalf;
  TORCH_CHECK(input.scalar_type() == at::kFloat && (half || weight.scalar_type() == at::kFloat),
              "skinny_linear: fp32 input and fp32 or fp16 weight expected, got ", input.scalar_type(), " and ",
              weight.scalar_type());
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
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kTileN - 1) / kTileN;
  // Grain: at least ~16K weights per task so that thread hand-off stays negligible.
  const int64_t grain = std::max<int64_t>(1, (16384 + kTileN * K - 1) / (kTileN * K));
  if (!half) {
    const float* wp = weight.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kTileN;
        rows_times_rows(xp, M, wp + n * K, K, yp + n, N, std::min<int64_t>(kTileN, N - n));
      }
    });
    return y;
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::Half>());
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> wide(M > kInRegisterRows ? kTileN * K : 0);
    const int64_t full = std::min(b1, N / kTileN);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kTileN, nt = std::min<int64_t>(kTileN, N - n);
      if (M <= kInRegisterRows) {
        const uint16_t* ahead = b + kPrefetchBlocks < full ? wp + (n + kPrefetchBlocks * kTileN) * K : nullptr;
        rows_times_rows(xp, M, wp + n * K, K, yp + n, N, nt, ahead);
      } else {
        widen(wp + n * K, nt * K, wide.data());
        rows_times_rows(xp, M, wide.data(), K, yp + n, N, nt);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("skinny_linear(Tensor input, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("skinny_linear", skinny_linear); }
