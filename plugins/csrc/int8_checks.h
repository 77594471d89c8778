// The argument checks of an INT8 LM-head kernel on the row-major table (int8_linear.cpp; int8_linear_q8.cpp
// takes its own packed layout and checks that): each error names the operator it came from.
#pragma once
#include <ATen/ATen.h>

namespace morphserve_cpu {

// x [M, K] fp32, an int8 weight [N, K] (contiguous) and its fp32 row scales [N] (contiguous), all on the CPU.
inline void check_int8_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& scales) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, op, ": fp32 input expected, got ", input.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kChar, op, ": int8 weight expected, got ", weight.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": fp32 scales expected, got ", scales.scalar_type());
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), op,
              ": CPU tensors expected");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), op, ": contiguous 2-D weight [N, K] expected");
  TORCH_CHECK(input.dim() == 2, op, ": 2-D input [M, K] expected, got ", input.dim(), " dims");
  TORCH_CHECK(input.size(1) == weight.size(1), op, ": input has ", input.size(1), " features, weight expects ",
              weight.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == weight.size(0) && scales.is_contiguous(), op,
              ": contiguous scales [", weight.size(0), "] expected, got ", scales.sizes());
}

}  // namespace morphserve_cpu
