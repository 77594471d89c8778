"""The INT8 table's int8-activation linear (W8A8): the VNNI kernel (csrc/int8_linear_q8.cpp) against its torch
twin and the exact product, batch independence, the dispatch of `set_head_activations`, bad input."""
from __future__ import annotations

import pytest
import torch

from plugins import int8_linear, skinny_gemm
from plugins.int8_linear import Int8Table, Q8_BLOCK, quantize_activations, reference_linear, reference_linear_q8

ns = int8_linear.cpu_kernels.ops()
needs_vnni = pytest.mark.skipif(not int8_linear.q8_kernel_supported(), reason="no AVX-512 VNNI kernel on this machine")


def table(n: int, k: int, seed: int = 0) -> Int8Table:
    return Int8Table.from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 30  # an outlier feature, as final hidden states have: its block's scale is coarser than the others'
    return x


@pytest.fixture
def activations():
    previous = int8_linear.set_head_activations("float32")
    yield int8_linear.set_head_activations
    int8_linear.set_head_activations(previous)


def test_quantized_activations_are_within_half_a_step():
    x = rows(5, 192, seed=1)
    q, d = quantize_activations(x)
    assert q.dtype == torch.int8 and d.shape == (5, 192 // Q8_BLOCK)
    back = (q.float().reshape(5, 3, Q8_BLOCK) * d[..., None]).reshape(5, 192)
    step = d.repeat_interleave(Q8_BLOCK, dim=1)
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all())
    assert int(q.abs().max()) == 127  # absmax maps to +-127
    zq, zd = quantize_activations(torch.zeros(1, 64))  # an all-zero block: scale 0, no division by zero
    assert int(zq.abs().max()) == 0 and float(zd.max()) == 0.0


def test_torch_twin_is_the_exact_product_of_the_quantized_rows():
    t = table(300, 192, seed=2)
    x = rows(6, 192, seed=3)
    q, d = quantize_activations(x)
    xd = (q.double().reshape(6, 3, Q8_BLOCK) * d.double()[..., None]).reshape(6, 192)
    want = ((xd @ t.weight.double().t()) * t.scales.double()).float()
    got = reference_linear_q8(x, t.weight, t.scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # and int8 activations stay close to the fp32-activation product (the quality cost is measured offline)
    full = reference_linear(x, t.weight, t.scales)
    assert float((got - full).abs().max()) < 0.02 * float(full.abs().max())


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 576), (13, 64), (8, 128), (1, 64)])
def test_kernel_matches_its_torch_twin(m, n, k):
    t = table(n, k, seed=m + n + k)
    x = rows(m, k, seed=m)
    got = ns.int8_linear_q8(x, t.weight, t.scales)
    assert got.shape == (m, n)
    want = reference_linear_q8(x, t.weight, t.scales)  # the same integer sums; fp32 block order differs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-6)


@needs_vnni
@pytest.mark.parametrize("n", [49, 64, 8])
def test_a_rows_result_does_not_depend_on_its_batch(n, activations):
    # one row runs the 1x8 tile, more rows the 4x4 tiles and the 1-3 row tails, 49 columns a partial group
    t = table(n, 576, seed=3)
    x = rows(skinny_gemm.MAX_ROWS, 576, seed=4)
    alone = torch.cat([ns.int8_linear_q8(x[i : i + 1], t.weight, t.scales) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 7, 16, 31, skinny_gemm.MAX_ROWS):
        assert torch.equal(ns.int8_linear_q8(x[:m], t.weight, t.scales), alone[:m]), m
    activations("int8")
    assert torch.equal(t.linear(x[:7]), alone[:7])  # the wrapper dispatches decode batches to the kernel


def test_the_setting_dispatches_and_falls_back(activations):
    t = table(100, 128, seed=7)
    x = rows(60, 128, seed=8)
    assert activations("int8") == "float32"
    # prefill-sized batches (and machines without the kernel) take the torch twin, with the same numerics
    assert torch.equal(t.linear(x), reference_linear_q8(x, t.weight, t.scales))
    odd = table(10, 20, seed=9)  # a feature count that is no multiple of the block keeps fp32 activations
    y = torch.randn(3, 20, generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(odd.linear(y), reference_linear(y, odd.weight, odd.scales), rtol=1e-4, atol=1e-5)
    assert activations("float32") == "int8"
    torch.testing.assert_close(t.linear(x), reference_linear(x, t.weight, t.scales), rtol=0, atol=0)
    activations("auto")
    assert activations("float32") == ("int8" if int8_linear.q8_kernel_supported() else "float32")
    with pytest.raises(ValueError, match="lm_head_activations must be one of"):
        activations("int4")


@needs_vnni
def test_a_nan_row_stays_in_its_row():
    t = table(40, 128, seed=11)
    x = rows(3, 128, seed=12)
    x[1, 70] = float("nan")
    got = ns.int8_linear_q8(x, t.weight, t.scales)
    assert bool(got[1].isnan().all())
    assert torch.equal(got[[0, 2]], ns.int8_linear_q8(x[[0, 2]], t.weight, t.scales))


@needs_vnni
def test_kernel_rejects_bad_input():
    w = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 weight"):
        ns.int8_linear_q8(torch.zeros(1, 64), w.float(), torch.ones(4))
    with pytest.raises(RuntimeError, match="features"):
        ns.int8_linear_q8(torch.zeros(1, 63), w, torch.ones(4))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ns.int8_linear_q8(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    with pytest.raises(RuntimeError, match="scales"):
        ns.int8_linear_q8(torch.zeros(1, 64), w, torch.ones(3))
    with pytest.raises(RuntimeError, match="fp32 input"):
        ns.int8_linear_q8(torch.zeros(1, 64, dtype=torch.float64), w, torch.ones(4))
