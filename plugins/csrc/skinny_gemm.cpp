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

using morphserve_cpu::dense_blocks;
using morphserve_cpu::num_blocks;

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
  const int64_t blocks = num_blocks(N);
  // Grain: at least ~16K weights per task so that thread hand-off stays negligible.
  const int64_t grain = std::max<int64_t>(1, (16384 + morphserve_cpu::kTileN * K - 1) / (morphserve_cpu::kTileN * K));
  auto run = [&](const auto* wp) {
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> wide;
      dense_blocks(xp, M, wp, K, yp, N, b0, b1, wide);
    });
  };
  if (half) run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::Half>()));
  else run(weight.data_ptr<float>());
  return y;
}

// Lets the dense kernels use the 4-row AVX-512VL tiles where the CPU has them (1) or not (0) when `on` >= 0;
// returns the setting before the call. The results are bitwise the same either way: this exists to measure.
int64_t dense_wide_tile(int64_t on) {
  TORCH_CHECK(on >= -1 && on <= 1, "dense_wide_tile: 0 (off), 1 (where the CPU has it) or -1 (read) expected, got ", on);
  const int previous = morphserve_cpu::use_wide_tile.load();
  if (on >= 0) morphserve_cpu::use_wide_tile.store(static_cast<int>(on));
  return previous;
}

// Lets the dense kernels prefetch the weight rows they read next (1) or not (0) when `on` >= 0; returns the
// setting before the call. The results are bitwise the same either way: this exists to measure.
int64_t dense_prefetch(int64_t on) {
  TORCH_CHECK(on >= -1 && on <= 1, "dense_prefetch: 0 (off), 1 (on) or -1 (read) expected, got ", on);
  const int previous = morphserve_cpu::use_dense_prefetch.load();
  if (on >= 0) morphserve_cpu::use_dense_prefetch.store(static_cast<int>(on));
  return previous;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("skinny_linear(Tensor input, Tensor weight) -> Tensor");
  m.def("dense_wide_tile(int on) -> int", dense_wide_tile);  // no tensors: a catch-all kernel
  m.def("dense_prefetch(int on) -> int", dense_prefetch);
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("skinny_linear", skinny_linear); }
