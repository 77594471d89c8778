"""The INT8 table: a [rows, dim] weight stored as int8 with one scale per row, used both as a linear (the LM
head: x @ W.T) and as a lookup table (the embedding: W[ids]). It is the quantized form of the tied
embedding / LM head, the unit the morph manager swaps besides the decoder layers.

Portable form (the fragment file): the INT8 layer fragments' format, `quant_matmul.quantize_int8` (symmetric
per output row, `<p>.weight` int8 [rows, dim], `<p>.scales` bf16 [rows]). Resident form: the same int8 bytes
and the scales widened to fp32 (exact).

Dispatch of the linear: the C++ kernel `morphserve::int8_linear` (csrc/int8_linear.cpp) for fp32 CPU batches
up to `skinny_gemm.MAX_ROWS` rows (decode: it reads the int8 bytes once per step, a row's result does not
depend on its batch); otherwise (prefill-sized batches, no kernels, CUDA) the torch reference, which
dequantizes `CHUNK_ROWS` weight rows at a time for MKL so that the transient stays small (9 MB fp32 here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels, skinny_gemm
from .quant_matmul import quantize_int8

CHUNK_ROWS = 4096


def reference_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [M, K] fp32 @ (weight int8 [N, K] * scales [N, 1]).T, chunked over N (the torch path)."""
    n = weight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    xf = x.float()
    for n0 in range(0, n, CHUNK_ROWS):
        n1 = min(n, n0 + CHUNK_ROWS)
        y[:, n0:n1] = F.linear(xf, weight[n0:n1].float() * scales[n0:n1, None].float())
    return y


class Int8Table:
    """int8 rows with fp32 per-row scales; `linear` for the LM head, `lookup` for the embedding."""

    __slots__ = ("weight", "scales", "_cpp")

    def __init__(self, weight: Tensor, scales: Tensor):
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Table: int8 [rows, dim] weight expected, got {weight.dtype} {tuple(weight.shape)}")
        if scales.shape != (weight.shape[0],):
            raise ValueError(f"Int8Table: scales of shape ({weight.shape[0]},) expected, got {tuple(scales.shape)}")
        self.weight = weight.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self._cpp = None if weight.is_cuda else cpu_kernels.ops()

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str = "") -> "Int8Table":
        return cls(tensors[prefix + "weight"], tensors[prefix + "scales"])

    @classmethod
    def from_float(cls, weight: Tensor) -> "Int8Table":
        return cls.from_tensors(quantize_int8(weight))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4

    def linear(self, x: Tensor) -> Tensor:
        """x [M, dim] -> fp32 [M, rows]."""
        if self._cpp is not None and x.dim() == 2 and x.shape[0] <= skinny_gemm.MAX_ROWS and x.dtype == torch.float32:
            return self._cpp.int8_linear(x, self.weight, self.scales)
        return reference_linear(x, self.weight, self.scales)

    def lookup(self, ids: Tensor) -> Tensor:
        """The dequantized rows `ids` (any shape) -> fp32 [*ids.shape, dim]."""
        return self.weight[ids].float() * self.scales[ids].unsqueeze(-1)

    def dequantize(self) -> Tensor:
        """The effective fp32 weight (tests, quality checks)."""
        return self.weight.float() * self.scales[:, None]
