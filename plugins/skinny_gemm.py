"""Dense linear dispatch: the C++ skinny GEMM for fp32 CPU decode batches (fp32 or fp16-stored weights),
`F.linear` (MKL) otherwise. bf16-stored weights (weight_dtype=bfloat16) multiply bf16 inputs with fp32
accumulation: the C++ AVX512_BF16 kernel at every batch, prefill chunks included (csrc/bf16_linear.cpp: level
with torch's bf16 linear from 256 rows, ahead below, and its fp32 in and out spare the engine two conversions of
every activation), and torch's bf16 linear (oneDNN) on CPUs without AVX512_BF16.

On this AVX2 CPU MKL's sgemm reaches about half the memory bandwidth at batch 1 and slows down per row at
batch 2-32, while a decode step's matmuls are bound by reading the weights once. The kernel
(csrc/skinny_gemm.cpp) reads each weight row once and reuses it from L1 for every row of the batch;
`tools/bench_engine.py` prints both. Above `MAX_ROWS` rows (prefill chunks) MKL is faster and is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels

# NOTE: rows of x up to which the kernel beats MKL here (measured crossover ~64 rows for SmolLM2's shapes).
MAX_ROWS = 48


_bf16_cpu: list[bool] = []  # whether the CPU has AVX512_BF16, asked of the library once


def bf16_kernel_available() -> bool:
    """Whether bf16 weights take the C++ AVX512_BF16 kernel (else torch's bf16 linear)."""
    ns = cpu_kernels.ops()
    if ns is None:
        return False
    if not _bf16_cpu:
        _bf16_cpu.append(bool(ns.bf16_linear_supported()))
    return _bf16_cpu[0]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T; the weight may be stored in fp16 under fp32 activations (widened here), or in
    bf16 (the inputs are then rounded to bf16 too, and the sums kept in fp32)."""
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        if x.dim() == 2 and not x.is_cuda and bf16_kernel_available():
            return cpu_kernels.ops().bf16_linear(x, weight)
        return F.linear(x.to(torch.bfloat16), weight).to(torch.float32)
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and not x.is_cuda
        and weight.dtype in (torch.float32, torch.float16)
    ):
        ns = cpu_kernels.ops()
        if ns is not None:
            return ns.skinny_linear(x, weight)
    # NOTE: prefill chunks (and the no-kernel path) widen a 16-bit stored weight for MKL: a transient fp32
    # copy, ~1 ms per layer against tens of ms of GEMM.
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
