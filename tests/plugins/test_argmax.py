"""plugins.argmax: the C++ row argmax against torch.argmax (ties, NaN, infinities, tails), and bad input."""

from __future__ import annotations

import pytest
import torch

from plugins import argmax, cpu_kernels

ns = cpu_kernels.ops()
needs_kernels = pytest.mark.skipif(
    ns is None, reason=f"C++ kernels unavailable: {cpu_kernels.unsupported_reason() or 'not built: run make setup'}"
)


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(m, n, generator=g) for m, n in [(1, 49152), (16, 49152), (3, 17), (2, 7), (5, 1), (4, 16)]]
    ties = torch.zeros(4, 40)
    ties[0, [3, 11, 30]] = 2.0  # the same maximum in several lanes: the first index wins
    ties[1, [30, 3]] = 5.0
    ties[2] = float("-inf")  # all -inf: index 0
    ties[3, 39] = float("inf")  # in the tail
    out.append(ties)
    nan = torch.randn(6, 50, generator=g)
    nan[0, 45] = float("nan")  # in the tail, after the lanes
    nan[1, 9] = float("nan")
    nan[1, 2] = float("nan")  # the first NaN wins
    nan[2, 0] = float("nan")
    nan[3, 20] = float("inf")
    nan[3, 30] = float("nan")  # a NaN beats inf
    out.append(nan)
    short = torch.tensor([[1.0, float("nan"), 3.0], [float("nan"), 0.0, 1.0], [2.0, 2.0, 1.0]])
    out.append(short)
    return out


@needs_kernels
@pytest.mark.parametrize("i", range(len(_cases())))
def test_argmax_rows_gives_torchs_index(i):
    x = _cases()[i]
    assert torch.equal(ns.argmax_rows(x), torch.argmax(x, dim=-1))


@needs_kernels
def test_argmax_rows_reads_a_non_contiguous_view():
    x = torch.randn(8, 100).t()  # [100, 8], strided
    assert torch.equal(argmax.argmax_rows(x), torch.argmax(x, dim=-1))


def test_argmax_falls_back_to_torch_off_the_kernels():
    x = torch.randn(3, 20, dtype=torch.float64)
    assert torch.equal(argmax.argmax_rows(x), torch.argmax(x, dim=-1))


@needs_kernels
def test_argmax_rows_names_a_bad_input():
    with pytest.raises(RuntimeError, match="2-D fp32"):
        ns.argmax_rows(torch.randn(3, 4, 5))
    with pytest.raises(RuntimeError, match="length 0"):
        ns.argmax_rows(torch.empty(2, 0))
