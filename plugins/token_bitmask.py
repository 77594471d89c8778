"""Structured outputs' allowed-token bitmasks applied to logits in place: the C++ op (csrc/token_bitmask.cpp) on
contiguous fp32 CPU logits, numpy's unpackbits and a masked fill elsewhere; both set exactly the logits whose bit
is clear to -inf (bit t of a row: int32 word t // 32, bit t % 32)."""

from __future__ import annotations

import numpy as np
import torch

from . import cpu_kernels


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [batch, vocab]; bitmask int32 [len(rows), words] (words * 32 >= vocab): row i masks logits[rows[i]]."""
    if not rows:
        return
    ns = cpu_kernels.ops()
    if (
        ns is not None
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and not logits.is_cuda
        and logits.is_contiguous()
        and bitmask.is_contiguous()
    ):
        ns.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        return
    reference_apply_(logits, bitmask, rows)


def reference_apply_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The same in numpy and torch ops (little-endian bit order)."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(bits == 0).to(logits.device)
    if rows == list(range(logits.shape[0])):  # every row: no gather, no scatter
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
