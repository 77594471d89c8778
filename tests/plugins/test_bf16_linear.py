"""The bf16 dense kernel (csrc/bf16_linear.cpp, bf16_tile.h) and its dispatch in plugins/skinny_gemm.py: bf16
inputs and weights with fp32 sums, a row's result independent of its batch and of the prefetch, bad input
rejected, decode rows and prefill chunks on the kernel, CPUs without AVX512_BF16 on torch's bf16 linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.plugins.test_cpu_kernels import needs_kernels, ns

from plugins import skinny_gemm

needs_bf16 = pytest.mark.skipif(
    not skinny_gemm.bf16_kernel_available(), reason="the C++ kernels are not built or the CPU lacks AVX512_BF16"
)


def _inputs(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), (torch.randn(n, k, generator=g) * 0.05).bfloat16()


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact products of the bf16-rounded inputs and weights, summed in fp64."""
    return (x.bfloat16().double() @ w.double().T).float()


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, skinny_gemm.MAX_ROWS, 131])
@pytest.mark.parametrize(("n", "k"), [(7, 100), (13, 33), (24, 64), (960, 576), (576, 1536)])
def test_bf16_linear_is_the_product_of_bf16_rounded_inputs(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n + k)
    got = ns.bf16_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 sums of exact bf16 products: only the order of the additions differs from the fp64 reference
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("m", [2, 5, 17])
def test_bf16_linear_rows_do_not_depend_on_the_batch(m):
    x, w = _inputs(m, 45, 70, seed=m)
    batched = ns.bf16_linear(x, w)
    for i in range(m):
        assert torch.equal(ns.bf16_linear(x[i : i + 1], w), batched[i : i + 1])


@needs_bf16
def test_bf16_linear_prefetch_changes_no_bit():
    x, w = _inputs(6, 600, 576, seed=5)  # enough blocks that the prefetch runs ahead
    previous = ns.dense_prefetch(0)
    try:
        off = ns.bf16_linear(x, w)
        ns.dense_prefetch(1)
        on = ns.bf16_linear(x, w)
    finally:
        ns.dense_prefetch(previous)
    assert torch.equal(off, on)


@needs_bf16
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda: ns.bf16_linear(torch.randn(2, 8), torch.randn(3, 8).half()), "fp32 input and bf16 weight"),
        (lambda: ns.bf16_linear(torch.randn(2, 8).double(), torch.randn(3, 8).bfloat16()), "got Double and BFloat16"),
        (lambda: ns.bf16_linear(torch.randn(2, 8), torch.randn(3, 9).bfloat16()), "8 features, weight expects 9"),
        (lambda: ns.bf16_linear(torch.randn(2, 3, 8), torch.randn(3, 8).bfloat16()), "2-D input"),
        (lambda: ns.bf16_linear(torch.randn(2, 8), torch.randn(8, 3).bfloat16().t()), "contiguous 2-D weight"),
    ],
)
def test_bf16_linear_rejects_bad_input(bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad()


@needs_bf16
def test_linear_dispatch_takes_the_kernel_for_decode_rows_and_prefill_chunks_alike():
    x, w = _inputs(4 * skinny_gemm.MAX_ROWS + 3, 40, 96, seed=3)
    for rows in (1, skinny_gemm.MAX_ROWS, x.shape[0]):
        got = skinny_gemm.linear(x[:rows], w)
        assert got.dtype == torch.float32 and torch.equal(got, ns.bf16_linear(x[:rows], w))
    torch.testing.assert_close(got, _reference(x, w), rtol=1e-5, atol=1e-5)  # fp32 out: not rounded to bf16
    assert torch.equal(got[:5], skinny_gemm.linear(x[:5], w))  # a prompt's rows are its decode rows' numbers


@needs_kernels
def test_linear_dispatch_runs_bf16_weights_on_torch_where_the_cpu_lacks_avx512_bf16(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_available", lambda: False)
    x, w = _inputs(3, 20, 64, seed=9)
    assert torch.equal(skinny_gemm.linear(x, w), F.linear(x.bfloat16(), w).float())
