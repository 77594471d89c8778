"""Greedy sampling's argmax over each row of the logits: the C++ op (csrc/argmax_rows.cpp) on fp32 CPU rows,
torch.argmax elsewhere; both give the first index of the largest value, a NaN counting as the largest."""

from __future__ import annotations

import torch

from . import cpu_kernels


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> int64 [rows]."""
    ns = cpu_kernels.ops()
    if (
        ns is not None
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and not logits.is_cuda
        and logits.shape[1] > 0
    ):
        return ns.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)
