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


def kernel(x: torch.Tensor, t: Int8Table) -> torch.Tensor:
    """The VNNI kernel on the table's rows, packed into its layout here."""
    return ns.int8_linear_q8(x, ns.int8_pack_q8(t.weight), t.scales)


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
    got = kernel(x, t)
    assert got.shape == (m, n)
    want = reference_linear_q8(x, t.weight, t.scales)  # the same integer sums; fp32 block order differs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-6)


@needs_vnni
@pytest.mark.parametrize("n", [49, 64, 8])
def test_a_rows_result_does_not_depend_on_its_batch(n, activations):
    # passes of 8 rows, then of 4, 2 and 1; 49 columns end in a partial block of 16
    t = table(n, 576, seed=3)
    x = rows(skinny_gemm.MAX_ROWS, 576, seed=4)
    alone = torch.cat([kernel(x[i : i + 1], t) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 7, 16, 31, skinny_gemm.MAX_ROWS):
        assert torch.equal(kernel(x[:m], t), alone[:m]), m
    activations("int8")
    assert torch.equal(t.linear(x[:7]), alone[:7])  # the wrapper dispatches decode batches to the kernel


def test_the_setting_dispatches_and_falls_back(activations):
    t = table(100, 128, seed=7)
    x = rows(60, 128, seed=8)
    assert activations("int8") == "float32"
    # prefill-sized batches go through the kernel in decode-sized pieces (each row its decode-row result); without
    # the kernel, the torch twin
    if int8_linear.q8_kernel_supported():
        assert torch.equal(t.linear(x), kernel(x, t))
        torch.testing.assert_close(t.linear(x), reference_linear_q8(x, t.weight, t.scales), rtol=1e-5, atol=1e-5)
    else:
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
    got = kernel(x, t)
    assert bool(got[1].isnan().all())
    assert torch.equal(got[[0, 2]], kernel(x[[0, 2]], t))


@needs_vnni
def test_kernel_rejects_bad_input():
    w = torch.zeros(4, 64, dtype=torch.int8)
    packed = ns.int8_pack_q8(w)
    with pytest.raises(RuntimeError, match="int8 CPU weight"):
        ns.int8_pack_q8(w.float())
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ns.int8_pack_q8(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="from int8_pack_q8"):
        ns.int8_linear_q8(torch.zeros(1, 64), w, torch.ones(4))  # the row-major table, not the packed one
    with pytest.raises(RuntimeError, match="features"):
        ns.int8_linear_q8(torch.zeros(1, 63), packed, torch.ones(4))
    with pytest.raises(RuntimeError, match="scales"):
        ns.int8_linear_q8(torch.zeros(1, 64), packed, torch.ones(17))
    with pytest.raises(RuntimeError, match="fp32 CPU input"):
        ns.int8_linear_q8(torch.zeros(1, 64, dtype=torch.float64), packed, torch.ones(4))


@needs_vnni
def test_the_table_holds_one_packed_form_and_gives_back_its_rows_and_lookups(activations):
    activations("int8")
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(13)) * 0.05
    t = Int8Table.from_float(w)
    ref = int8_linear.quantize_int8(w)
    assert t._rows is None and t.nbytes == 3 * 16 * 128 + 37 * 4  # 37 rows padded to 3 blocks of 16, one form
    assert torch.equal(t.weight, ref["weight"])  # rebuilt exactly from the packed bytes
    ids = torch.tensor([[0, 36], [15, 16]])
    want = ref["weight"][ids].float() * ref["scales"].float()[ids].unsqueeze(-1)
    assert torch.equal(t.lookup(ids), want)


@needs_vnni
def test_lookup_op_equals_its_torch_twin_for_any_ids_shape():
    t = table(53, 192, seed=21)  # 53 rows: the last block of 16 is padded
    packed = t._packed if t._packed is not None else ns.int8_pack_q8(t.weight)
    for ids in (
        torch.tensor([52]),
        torch.tensor([[0, 15, 16], [31, 52, 7]]),
        torch.randint(0, 53, (4, 2, 5)),
        torch.empty(0, dtype=torch.long),
    ):
        got = ns.int8_lookup_q8(ids, packed, t.scales)
        assert got.shape == (*ids.shape, 192)
        assert torch.equal(got, int8_linear.reference_lookup_q8(ids, packed, t.scales, 192))


@needs_vnni
def test_lookup_op_rejects_bad_ids_and_tables():
    t = table(20, 64, seed=22)
    packed = ns.int8_pack_q8(t.weight)
    with pytest.raises(RuntimeError, match="id 20 is outside the table's 20 rows"):
        ns.int8_lookup_q8(torch.tensor([3, 20]), packed, t.scales)
    with pytest.raises(RuntimeError, match="id -1 is outside"):
        ns.int8_lookup_q8(torch.tensor([-1]), packed, t.scales)
    with pytest.raises(RuntimeError, match="int64 CPU ids"):
        ns.int8_lookup_q8(torch.tensor([1.0]), packed, t.scales)
    with pytest.raises(RuntimeError, match="packed table"):
        ns.int8_lookup_q8(torch.tensor([1]), t.weight, t.scales)
    with pytest.raises(RuntimeError, match="scales of at most 32 rows"):
        ns.int8_lookup_q8(torch.tensor([1]), packed, torch.ones(33))


@needs_vnni
def test_changing_the_activations_re_lays_out_live_tables_holding_one_form(activations):
    activations("int8")
    t = table(40, 128, seed=14)
    x = rows(3, 128, seed=15)
    want_rows, q8 = t.weight.clone(), t.linear(x)
    assert t._rows is None and t._packed is not None
    activations("float32")  # the row-major rows the fp32 kernel reads, the packed copy dropped
    assert t._packed is None and torch.equal(t._rows, want_rows) and t.nbytes == 40 * 128 + 40 * 4
    got = t.linear(x)
    assert torch.equal(got, ns.int8_linear(x, want_rows, t.scales))  # the C++ fp32 kernel, not a rebuild per call
    torch.testing.assert_close(got, reference_linear(x, t.weight, t.scales), rtol=1e-5, atol=1e-5)
    activations("int8")  # and back, bit for bit
    assert t._rows is None and torch.equal(t.weight, want_rows) and torch.equal(t.linear(x), q8)


def test_a_table_made_under_fp32_activations_holds_the_rows(activations):
    t = table(32, 128, seed=16)
    assert t._packed is None and t._rows is not None and t.nbytes == 32 * 128 + 32 * 4
