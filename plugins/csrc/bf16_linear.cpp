// Dense GEMM with bf16 inputs and fp32 accumulation for decode batches: y[M, N] = x[M, K] @ w[N, K]^T, x fp32
// (rounded to bf16 once per call, to nearest even as torch rounds), w stored in bf16, y fp32. This is the
// weight_dtype=bfloat16 path: the numerics vLLM's CPU backend serves in, at the bytes of fp16 storage, with
// AVX512_BF16's dot product doing two multiply-adds per lane where the fp32 tile (cpu_tile.h) does one. The tile
// is bf16_tile.h's (the fused decode step runs the same). Threads split the output blocks (torch's intra-op
// pool). Only where the CPU has AVX512_BF16 (bf16_linear_supported); elsewhere plugins/skinny_gemm.py uses torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_tile.h"

namespace {

namespace bf16 = morphserve_cpu::bf16;

at::Tensor bf16_linear(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(morphserve_cpu::cpu_has_avx512_bf16(), "bf16_linear: this CPU lacks AVX512_BF16");
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16,
              "bf16_linear: fp32 input and bf16 weight expected, got ", input.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors expected");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "bf16_linear: contiguous 2-D weight [N, K] expected");
  TORCH_CHECK(input.dim() == 2, "bf16_linear: 2-D input [M, K] expected, got ", input.dim(), " dims");
  TORCH_CHECK(input.size(1) == weight.size(1), "bf16_linear: input has ", input.size(1), " features, weight expects ",
              weight.size(1));
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<uint16_t> xb(M * K);
  bf16::round_to_bf16(x.data_ptr<float>(), M * K, xb.data());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (16384 + bf16::kWeightRows * K - 1) / (bf16::kWeightRows * K));
  at::parallel_for(0, bf16::num_blocks(N), grain,
                   [&](int64_t b0, int64_t b1) { bf16::bf16_blocks(xb.data(), M, wp, K, yp, N, b0, b1); });
  return y;
}

bool bf16_linear_supported() { return morphserve_cpu::cpu_has_avx512_bf16(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("bf16_linear(Tensor input, Tensor weight) -> Tensor");
  m.def("bf16_linear_supported() -> bool", bf16_linear_supported);  // no tensors: a catch-all kernel
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("bf16_linear", bf16_linear); }
