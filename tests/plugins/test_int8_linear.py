"""The INT8 table (plugins/int8_linear.py) and its C++ linear against the torch reference: values, batch
independence, the embedding lookup, quantization error, bad input."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels, int8_linear
from plugins.int8_linear import Int8Table, reference_linear

ns = cpu_kernels.ops()
needs_kernels = pytest.mark.skipif(
    ns is None, reason=f"C++ kernels unavailable: {cpu_kernels.unsupported_reason() or 'not built: run make setup'}"
)


@pytest.fixture(autouse=True)
def fp32_activations():
    """These tests are about the fp32-activation path; an engine built earlier in the process may have set int8."""
    previous = int8_linear.set_head_activations("float32")
    yield
    int8_linear.set_head_activations(previous)


def table(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, Int8Table]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, Int8Table.from_float(w)


def exact(x: torch.Tensor, t: Int8Table) -> torch.Tensor:
    """The kernel's definition in float64: s[n] * (x . q[n])."""
    return ((x.double() @ t.weight.double().t()) * t.scales.double()).float()


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 576), (13, 20), (8, 8), (1, 3)])
def test_kernel_matches_the_exact_product(m, n, k):
    _, t = table(n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = ns.int8_linear(x, t.weight, t.scales)
    assert got.shape == (m, n)
    ref = exact(x, t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-6)
    # and the torch reference path agrees with it to fp32 rounding
    torch.testing.assert_close(
        reference_linear(x, t.weight, t.scales), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())
    )


@needs_kernels
@pytest.mark.parametrize("n", [49, 64])
def test_a_rows_result_does_not_depend_on_its_batch(n):
    # one row runs the 1x8 register tile, more rows the 2x4 and 1x4 tiles, the 13-row tail 1-row tiles: all sum alike
    _, t = table(n, 576, seed=3)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([ns.int8_linear(x[i : i + 1], t.weight, t.scales) for i in range(32)])
    for m in (2, 3, 5, 16, 32):
        assert torch.equal(ns.int8_linear(x[:m], t.weight, t.scales), alone[:m]), m
    if t._rows is not None:  # the wrapper dispatches decode batches to the kernel
        assert torch.equal(t.linear(x[:7]), alone[:7])
    else:  # a VNNI CPU's table holds the packed layout: fp32 activations take the torch path on rebuilt rows
        torch.testing.assert_close(t.linear(x[:7]), alone[:7], rtol=1e-5, atol=1e-6)


def test_quantization_error_is_at_most_half_a_step_per_weight():
    w, t = table(300, 64, seed=5)
    err = (t.dequantize() - w).abs()
    # scales are rounded to bf16 before q is chosen: q is the nearest step of the stored scale (clamped at 127)
    assert bool((err <= t.scales[:, None] / 2 * (1 + 1e-6) + 1e-9).all())
    rows_held = 304 if t._packed is not None else 300  # the VNNI layout pads to blocks of 16 rows
    assert t.nbytes == rows_held * 64 + 300 * 4


def test_lookup_dequantizes_the_rows_it_is_given():
    _, t = table(50, 16, seed=6)
    ids = torch.tensor([[3, 0], [49, 3]])
    got = t.lookup(ids)
    assert got.shape == (2, 2, 16) and got.dtype == torch.float32
    assert torch.equal(got, t.dequantize()[ids])


def test_torch_path_is_used_for_prefill_sized_batches_and_without_kernels(monkeypatch):
    _, t = table(100, 32, seed=7)
    x = torch.randn(60, 32, generator=torch.Generator().manual_seed(8))
    ref = reference_linear(x, t.weight, t.scales)
    assert torch.equal(t.linear(x), ref)  # more rows than skinny_gemm.MAX_ROWS
    monkeypatch.setattr(int8_linear, "CHUNK_ROWS", 7)  # chunking over the rows changes nothing
    torch.testing.assert_close(reference_linear(x, t.weight, t.scales), ref, rtol=0, atol=1e-6)
    t._cpp = None  # as built with MORPHSERVE_CPU_KERNELS=0
    torch.testing.assert_close(t.linear(x[:3]), exact(x[:3], t), rtol=1e-4, atol=1e-5)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="int8"):
        Int8Table(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        Int8Table(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3))


@needs_kernels
def test_kernel_rejects_bad_input():
    w = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 weight"):
        ns.int8_linear(torch.zeros(1, 8), w.float(), torch.ones(4))
    with pytest.raises(RuntimeError, match="features"):
        ns.int8_linear(torch.zeros(1, 7), w, torch.ones(4))
    with pytest.raises(RuntimeError, match="scales"):
        ns.int8_linear(torch.zeros(1, 8), w, torch.ones(3))
