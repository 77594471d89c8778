"""The C++ CPU kernels against the torch ops they replace: values, batch independence, bad input, fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine_fixtures import random_layer_tensors
from plugins import cpu_kernels, paged_attention, quant_matmul, skinny_gemm
from trtllm_backend import attention
from trtllm_backend.kv_cache import KVPool
from trtllm_backend.manifest import ModelConfig

ns = cpu_kernels.ops()
needs_kernels = pytest.mark.skipif(
    ns is None, reason=f"C++ kernels unavailable: {cpu_kernels.unsupported_reason() or 'not built: run make setup'}"
)


@pytest.mark.needs_model
def test_kernels_are_built_where_the_cpu_supports_them():
    # The set-up step builds them; a missing library on an AVX2 machine would silently cost 1.5-2x in decode.
    if cpu_kernels.unsupported_reason() is None:
        assert ns is not None, f"{cpu_kernels.library_path()} missing: run python -m plugins.cpu_kernels"


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 33])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 576), (5, 1536), (7, 13), (1, 8)])
def test_skinny_linear_matches_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ref = (x.double() @ w.double().t()).float()
    got = ns.skinny_linear(x, w)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * k**0.5)


@needs_kernels
@pytest.mark.parametrize("m", [3, 4, 7, 9, 32])  # 4-row tiles (AVX-512VL), then 2-row and 1-row ones
@pytest.mark.parametrize("half", [False, True])
def test_skinny_linear_rows_do_not_depend_on_the_batch(m, half):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(100, 576, generator=g)
    w = w.half() if half else w
    batched = ns.skinny_linear(x, w)
    for i in range(m):
        assert torch.equal(ns.skinny_linear(x[i : i + 1], w), batched[i : i + 1])


@needs_kernels
def test_skinny_linear_takes_strided_input():
    x = torch.randn(4, 1152)[:, ::2]
    w = torch.randn(6, 576)
    torch.testing.assert_close(ns.skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: ns.skinny_linear(torch.randn(2, 8), torch.randn(3, 9)), "8 features, weight expects 9"),
        (lambda: ns.skinny_linear(torch.randn(2, 8).double(), torch.randn(3, 8)), "fp32 input and fp32 or fp16 weight"),
        (lambda: ns.skinny_linear(torch.randn(2, 8), torch.randn(3, 8).bfloat16()), "got Float and BFloat16"),
        (lambda: ns.skinny_linear(torch.randn(2, 3, 8), torch.randn(3, 8)), "2-D input"),
        (lambda: ns.skinny_linear(torch.randn(2, 8), torch.randn(8, 3).t()), "contiguous 2-D weight"),
    ],
)
def test_skinny_linear_rejects_bad_input(bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad()


def _skinny_linear_off_and_on(switch, m, half, n, k, seed):
    """skinny_linear on one random x [m, k] and w [n, k] (fp16 if `half`) with the kernel setting `switch` (an op
    taking 0 / 1, -1 reads) at 0 and at 1, put back afterwards: ({0: y, 1: y}, the setting found, x, w)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    w = w.half() if half else w
    previous = switch(-1)
    try:
        got = {}
        for on in (0, 1):
            switch(on)
            got[on] = ns.skinny_linear(x, w)
    finally:
        switch(previous)
    return got, previous, x, w


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 16])  # in-register fp16, widened into a buffer, 4-row tiles
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("n,k", [(960, 576), (30, 1536)])  # many blocks ahead; prefetches stop before the end
def test_dense_prefetch_changes_no_bit(m, half, n, k):
    got, previous, x, w = _skinny_linear_off_and_on(ns.dense_prefetch, m, half, n, k, seed=m * 7 + n + k)
    assert previous == 1  # on unless a measurement turns it off
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[1], x @ w.float().T, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="dense_prefetch: 0"):
        ns.dense_prefetch(2)


@needs_kernels
@pytest.mark.skipif(not {"avx512f", "avx512vl"} <= (cpu_kernels.cpu_flags() or set()), reason="no AVX-512VL")
@pytest.mark.parametrize("m", [4, 7, 32])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 1536), (7, 13)])  # full blocks, a block and a tail, tail only
def test_dense_wide_tiles_give_the_same_bits_as_the_avx2_ones(m, half, n, k):
    got, _, _, _ = _skinny_linear_off_and_on(ns.dense_wide_tile, m, half, n, k, seed=m + n + k)
    assert torch.equal(got[0], got[1])  # the same per-output sums in the same order, only more rows per tile
    with pytest.raises(RuntimeError, match="dense_wide_tile: 0"):
        ns.dense_wide_tile(2)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 16, 33])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 576), (600, 100), (7, 13), (1, 8)])
def test_fp16_weights_give_exactly_the_fp32_result_of_their_widened_values(m, n, k):
    # Widened on load (in registers for 1-2 rows, into an L1 buffer beyond), summed in the same order.
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).half()
    got = ns.skinny_linear(x, w)
    assert torch.equal(got, ns.skinny_linear(x, w.float()))
    torch.testing.assert_close(got, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4 * k**0.5)


def test_linear_dispatch_widens_fp16_weights_for_prefill_sized_inputs():
    x, w = torch.randn(skinny_gemm.MAX_ROWS + 1, 32), torch.randn(16, 32).half()
    got = skinny_gemm.linear(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w.float()))


def test_linear_dispatch_uses_mkl_for_prefill_sized_and_non_fp32_inputs(monkeypatch):
    """Which path runs, not only what comes out: the C++ kernel (a stand-in that records its calls) for
    decode-sized fp32 inputs, torch's F.linear (MKL) for prefill-sized or non-fp32 ones, with the kernel present."""
    calls = []

    class Kernels:
        @staticmethod
        def skinny_linear(x, w):
            calls.append(("kernel", tuple(x.shape), x.dtype))
            return F.linear(x, w.to(x.dtype))

    def mkl(x, w, *args):
        calls.append(("mkl", tuple(x.shape), x.dtype))
        return torch_linear(x, w, *args)

    torch_linear = F.linear
    monkeypatch.setattr(skinny_gemm.cpu_kernels, "ops", lambda: Kernels)
    monkeypatch.setattr(skinny_gemm.F, "linear", mkl)
    w = torch.randn(16, 32)
    prefill, bf16, decode = (
        torch.randn(skinny_gemm.MAX_ROWS + 1, 32),
        torch.randn(2, 32).to(torch.bfloat16),
        torch.randn(2, 32),
    )
    for x in (prefill, bf16):
        ww = w.to(x.dtype)
        calls.clear()
        torch.testing.assert_close(skinny_gemm.linear(x, ww), torch_linear(x, ww))
        assert calls == [("mkl", tuple(x.shape), x.dtype)]
    calls.clear()
    skinny_gemm.linear(decode, w)
    assert calls[0] == ("kernel", (2, 32), torch.float32)  # the contrast: a decode-sized fp32 input


# ---- INT4 linear ----------------------------------------------------------------------------------------------


def _int4(n: int, k: int, seed: int = 0, group: int = 32):
    """Random INT4 weight: (packed, affine) as the kernel holds it, and the fp32 reference weight."""
    g = torch.Generator().manual_seed(seed)
    t = quant_matmul.quantize_int4(torch.randn(n, k, generator=g) * 0.02, group)
    packed, affine = ns.int4_pack(t["qweight"], t["scales_zeros"].transpose(0, 1).contiguous(), group)
    return packed, affine, quant_matmul.dequantize_int4(t)


@pytest.fixture
def fp32_activations():
    """The exact paths: fp32 activations in decode and fp32 prefill matmuls (an engine built earlier in the
    process may have set either process-wide)."""
    previous = quant_matmul.set_int4_activations("float32"), quant_matmul.set_int4_prefill("float32")
    yield
    quant_matmul.set_int4_activations(previous[0])
    quant_matmul.set_int4_prefill(previous[1])


@pytest.fixture(params=["float32", "int8"])
def activations(request):
    previous = quant_matmul.set_int4_activations(request.param)
    yield request.param
    quant_matmul.set_int4_activations(previous)


def _int8_reference(x: torch.Tensor, n: int, k: int, seed: int) -> torch.Tensor:
    """What the int8-activation kernel computes, in float64: x quantized per 32 inputs (absmax / 127, rounded
    half to even in fp32) times the dequantized weight, y = xhat @ W^T."""
    g = torch.Generator().manual_seed(seed)
    t = quant_matmul.quantize_int4(torch.randn(n, k, generator=g) * 0.02)
    q = quant_matmul.unpack_int4(t["qweight"]).double()  # [n, k], 0..15
    sz = t["scales_zeros"].float().double()  # [k/32, n, 2]
    xb = x.view(x.shape[0], k // 32, 32)
    a = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(a > 0, torch.tensor(127.0) / a, torch.zeros_like(a))
    xhat = (torch.round(xb * inv).double() * (a / 127.0).double()).view_as(x)
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [n, k/32]
    dot = torch.einsum("mgk,ngk->mng", xhat.view(x.shape[0], k // 32, 32), q.view(n, k // 32, 32))
    return (dot * s + (z - 8 * s) * xhat.view(x.shape[0], k // 32, 32).sum(-1)[:, None, :]).sum(-1).float()


@needs_kernels
@pytest.mark.parametrize("n", [100, 8, 1])
def test_int4_dequantize_gives_the_reference_weights(n):
    q, a, ref = _int4(n, 576)
    # the same bytes as the portable nibbles and bf16 scales/zeros (rows padded to 8), all in one stream
    assert q.shape == ((n + 7) // 8, 576 // 8 + 576 // 32, 32) and a.numel() == 0
    torch.testing.assert_close(ns.int4_dequantize(q, a, n, 32), ref, rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 16, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1, 130])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 1536), (1, 32), (40, 64)])
def test_int4_linear_matches_the_dequantized_matmul(m, n, k, fp32_activations):
    q, a, ref = _int4(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    want = (x.double() @ ref.double().t()).float()
    got = ns.int4_linear(x, q, a, None, n, 32, skinny_gemm.MAX_ROWS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, skinny_gemm.MAX_ROWS])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 1536), (1, 32), (40, 64)])
def test_int4_linear_with_int8_activations_matches_its_reference(m, n, k):
    q, a, _ = _int4(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
    previous = quant_matmul.set_int4_activations("int8")
    try:
        got = ns.int4_linear(x, q, a, None, n, 32, skinny_gemm.MAX_ROWS)
    finally:
        quant_matmul.set_int4_activations(previous)
    torch.testing.assert_close(got, _int8_reference(x, n, k, seed=m), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_bf16_prefill_is_close_to_fp32_and_leaves_decode_rows_alone():
    q, a, ref = _int4(960, 576, seed=7)
    x = torch.randn(skinny_gemm.MAX_ROWS + 5, 576, generator=torch.Generator().manual_seed(7))
    want = (x.double() @ ref.double().t()).float()
    got = {}
    for name in ("float32", "bfloat16"):
        previous = quant_matmul.set_int4_prefill(name)
        try:
            got[name] = (
                ns.int4_linear(x, q, a, None, 960, 32, skinny_gemm.MAX_ROWS),
                ns.int4_linear(x[:4], q, a, None, 960, 32, skinny_gemm.MAX_ROWS),
            )
        finally:
            quant_matmul.set_int4_prefill(previous)
    err = ((got["bfloat16"][0] - want).norm() / want.norm()).item()
    assert 1e-5 < err < 1e-2  # rounded to bf16 on the way in, accumulated in fp32
    assert torch.equal(got["bfloat16"][1], got["float32"][1])  # decode rows never take the prefill path
    with pytest.raises(ValueError, match="int4_prefill must be one of"):
        quant_matmul.set_int4_prefill("fp8")
    with pytest.raises(RuntimeError, match="2 \\(decode tiles\\) or -1 \\(read\\) expected, got 3"):
        ns.int4_prefill_mode(3)


@needs_kernels
@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("m", [skinny_gemm.MAX_ROWS + 1, 70, 128 + 7])  # one, two and several row chunks of 32
def test_decode_tiles_prefill_gives_each_row_the_bits_it_gets_as_a_decode_row(activations, m):
    # Prefill mode `decode` runs the rows through the decode tiles in chunks: row r of a prompt then equals row r
    # decoded alone (and in any decode batch: batch independence), so prompt and decode rows share numerics.
    n, k = 960, 576
    q, a, _ = _int4(n, k, seed=m)
    pre = torch.rand(k, generator=torch.Generator().manual_seed(m)) + 0.5  # AWQ's pre-scale, applied in the kernel
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    previous = quant_matmul.set_int4_activations(activations), quant_matmul.set_int4_prefill("decode")
    try:
        got = ns.int4_linear(x, q, a, pre, n, 32, skinny_gemm.MAX_ROWS)
        rows = [ns.int4_linear(x[r : r + 1], q, a, pre, n, 32, skinny_gemm.MAX_ROWS) for r in (0, 31, 32, m - 1)]
    finally:
        quant_matmul.set_int4_activations(previous[0])
        quant_matmul.set_int4_prefill(previous[1])
    for r, row in zip((0, 31, 32, m - 1), rows):
        assert torch.equal(got[r : r + 1], row), f"row {r}"


@needs_kernels
def test_auto_prefill_takes_the_decode_tiles_only_with_vnni_and_int8_activations():
    flags = cpu_kernels.cpu_flags() or set()
    vnni = {"avx512_vnni", "avx512bw"} <= flags
    bf16 = "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"
    previous = quant_matmul.set_int4_activations("int8"), quant_matmul.set_int4_prefill("float32")
    try:
        quant_matmul.set_int4_prefill("auto")
        assert quant_matmul.set_int4_prefill("auto") == ("decode" if vnni else bf16)
        quant_matmul.set_int4_activations("float32")
        quant_matmul.set_int4_prefill("auto")
        assert quant_matmul.set_int4_prefill("auto") == bf16  # fp32 activations: the tiles' slow path, not taken
    finally:
        quant_matmul.set_int4_activations(previous[0])
        quant_matmul.set_int4_prefill(previous[1])


@needs_kernels
@pytest.mark.parametrize("n", [960, 100, 7])
def test_bf16_prefill_multiplies_the_dequantized_weights_rounded_to_bf16(n):
    # Dequantized straight to bf16 in the kernel: the same weights as the fp32 dequantization rounded by torch,
    # so the same GEMM result bit for bit.
    q, a, ref = _int4(n, 576, seed=n)
    x = torch.randn(skinny_gemm.MAX_ROWS + 3, 576, generator=torch.Generator().manual_seed(n))
    previous = quant_matmul.set_int4_prefill("bfloat16")
    try:
        got = ns.int4_linear(x, q, a, None, n, 32, skinny_gemm.MAX_ROWS)
    finally:
        quant_matmul.set_int4_prefill(previous)
    want = torch.nn.functional.linear(x.bfloat16(), ns.int4_dequantize(q, a, n, 32).bfloat16()).float()
    assert torch.equal(got, want)


@needs_kernels
def test_int8_activations_cost_about_a_percent_and_spare_prefill(fp32_activations):
    q, a, ref = _int4(960, 576, seed=5)
    x = torch.randn(skinny_gemm.MAX_ROWS + 1, 576, generator=torch.Generator().manual_seed(5))
    want = (x.double() @ ref.double().t()).float()
    quant_matmul.set_int4_activations("int8")
    try:
        decode = ns.int4_linear(x[:8], q, a, None, 960, 32, skinny_gemm.MAX_ROWS)
        prefill = ns.int4_linear(x, q, a, None, 960, 32, skinny_gemm.MAX_ROWS)
    finally:
        quant_matmul.set_int4_activations("float32")
    err = ((decode - want[:8]).norm() / want[:8].norm()).item()
    assert 1e-4 < err < 2e-2  # quantized, and only slightly (absmax int8 per 32 inputs)
    torch.testing.assert_close(prefill, want, rtol=1e-5, atol=1e-5)  # prefill rows stay fp32


@needs_kernels
def test_int8_activations_fall_back_to_fp32_where_the_group_is_not_a_multiple_of_32():
    t = quant_matmul.quantize_int4(torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.02, 16)
    q, a = ns.int4_pack(t["qweight"], t["scales_zeros"].transpose(0, 1).contiguous(), 16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    got = {}
    for name in ("int8", "float32"):
        previous = quant_matmul.set_int4_activations(name)
        got[name] = ns.int4_linear(x, q, a, None, 16, 16, skinny_gemm.MAX_ROWS)
        quant_matmul.set_int4_activations(previous)
    assert torch.equal(got["int8"], got["float32"])


@needs_kernels
@pytest.mark.skipif(not {"avx512_vnni", "avx512bw"} <= (cpu_kernels.cpu_flags() or set()), reason="no AVX-512 VNNI")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, skinny_gemm.MAX_ROWS])  # passes of 4 rows, then of 1-3
@pytest.mark.parametrize("n,k", [(960, 576), (44, 1536), (7, 64)])  # full tiles, a tile and a tail, tail blocks only
@pytest.mark.parametrize("group", [32, 64])  # one or two activation blocks (kQBlock) per weight group
def test_int4_vnni_tiles_give_the_same_bits_as_the_avx2_ones(m, n, k, group):
    q, a, _ = _int4(n, k, seed=m + 1, group=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    previous = quant_matmul.set_int4_activations("int8"), ns.int4_vnni(-1)
    try:
        got = {}
        for on in (0, 1):
            ns.int4_vnni(on)
            got[on] = ns.int4_linear(x, q, a, None, n, group, skinny_gemm.MAX_ROWS)
    finally:
        quant_matmul.set_int4_activations(previous[0])
        ns.int4_vnni(previous[1])
    assert torch.equal(got[0], got[1])  # the same exact integer sums, the same converts and FMAs after them
    with pytest.raises(RuntimeError, match="int4_vnni: 0"):
        ns.int4_vnni(2)


@needs_kernels
@pytest.mark.parametrize("vnni", [0, 1])  # the AVX2 pass (group_q8) and the VNNI one (rows_q8_vnni)
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (44, 1536)])  # prefetches run past the last tile's end here
def test_int4_prefetch_changes_no_bit(vnni, m, n, k):
    if vnni and not {"avx512_vnni", "avx512bw"} <= (cpu_kernels.cpu_flags() or set()):
        pytest.skip("no AVX-512 VNNI")
    q, a, _ = _int4(n, k, seed=m + 7, group=64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    previous = quant_matmul.set_int4_activations("int8"), ns.int4_prefetch(-1), ns.int4_vnni(vnni)
    assert previous[1] > 0  # on by default
    try:
        got = {}
        for ahead in (0, 64, 4096, 1 << 20):  # a hint, never a read: even a megabyte past the weight is safe
            ns.int4_prefetch(ahead)
            got[ahead] = ns.int4_linear(x, q, a, None, n, 64, skinny_gemm.MAX_ROWS)
    finally:
        quant_matmul.set_int4_activations(previous[0])
        ns.int4_prefetch(previous[1])
        ns.int4_vnni(previous[2])
    assert all(torch.equal(got[0], g) for g in got.values())
    with pytest.raises(RuntimeError, match="int4_prefetch: 0..1048576"):
        ns.int4_prefetch(-2)


@needs_kernels
def test_int4_activation_setting_rejects_other_widths():
    with pytest.raises(ValueError, match="int4_activations must be one of"):
        quant_matmul.set_int4_activations("int4")
    with pytest.raises(RuntimeError, match=r"8 \(int8\) or 32 \(fp32\) expected, got 16"):
        ns.int4_activation_bits(16)


@needs_kernels
@pytest.mark.parametrize("n", [50, 96])  # a tile of 32 rows and 3 tail blocks of 8; full tiles only
def test_int4_linear_rows_do_not_depend_on_the_batch_up_to_the_skinny_limit(n, activations):
    q, a, _ = _int4(n, 576)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3))
    batched = ns.int4_linear(x, q, a, None, n, 32, skinny_gemm.MAX_ROWS)  # the unpacked-buffer path
    for i in range(9):  # one row and two rows: the in-register path
        assert torch.equal(ns.int4_linear(x[i : i + 1], q, a, None, n, 32, skinny_gemm.MAX_ROWS), batched[i : i + 1])
        if i < 8:
            assert torch.equal(
                ns.int4_linear(x[i : i + 2], q, a, None, n, 32, skinny_gemm.MAX_ROWS), batched[i : i + 2]
            )


@needs_kernels
@pytest.mark.parametrize("m", [1, 5, skinny_gemm.MAX_ROWS + 1])
def test_int4_linear_applies_the_pre_scale_as_a_multiply_before_it(m, activations):
    q, a, _ = _int4(40, 64)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
    s = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.equal(
        ns.int4_linear(x, q, a, s, 40, 32, skinny_gemm.MAX_ROWS),
        ns.int4_linear(x * s, q, a, None, 40, 32, skinny_gemm.MAX_ROWS),
    )


@needs_kernels
def test_int4_linear_rejects_bad_input():
    q, a, _ = _int4(8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="input has 32 features, weight expects 64"):
        ns.int4_linear(torch.randn(2, 32), q, a, None, 8, 32, 48)
    with pytest.raises(RuntimeError, match="group size 24"):
        ns.int4_linear(x, q, a, None, 8, 24, 48)
    with pytest.raises(RuntimeError, match="9 output features do not fit 1 packed blocks"):
        ns.int4_linear(x, q, a, None, 9, 32, 48)
    with pytest.raises(RuntimeError, match="scales and zeros are inside the packed weight"):
        ns.int4_linear(x, q, torch.zeros(1, 2, 2, 8, dtype=torch.bfloat16), None, 8, 32, 48)
    with pytest.raises(RuntimeError, match="group size 16 does not fit"):
        ns.int4_linear(x, q, a, None, 8, 16, 48)
    with pytest.raises(RuntimeError, match="fp32 CPU input"):
        ns.int4_linear(x.double(), q, a, None, 8, 32, 48)
    with pytest.raises(RuntimeError, match=r"fp32 pre_scale \[64\]"):
        ns.int4_linear(x, q, a, torch.ones(32), 8, 32, 48)
    with pytest.raises(RuntimeError, match=r"scales_zeros \[N, K/G, 2\]"):
        ns.int4_pack(torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(2, 8, 2, dtype=torch.bfloat16), 32)


@needs_kernels
def test_int4_operator_uses_the_kernel_and_agrees_with_torchs_bf16_kernel(monkeypatch, activations):
    # Seeded: the two paths round differently (int8 rows against bf16 rows and outputs), and an unseeded draw now
    # and then put one output past the tolerance.
    g = torch.Generator().manual_seed(29)
    w = torch.randn(96, 576, generator=g) * 0.02
    ours = quant_matmul.Int4Linear.from_float(w)
    assert ours._cpp is not None
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    theirs = quant_matmul.Int4Linear.from_float(w)
    assert theirs._cpp is None and ours.nbytes == theirs.nbytes  # one resident form either way
    for m in (1, 8, 64):
        x = torch.randn(m, 576, generator=g)
        torch.testing.assert_close(
            ours(x), theirs(x), rtol=2e-2, atol=1e-2
        )  # theirs rounds x and y to bf16 (outputs ~0.5)


# ---- paged decode attention ----------------------------------------------------------------------------------

CFG = ModelConfig(
    vocab_size=16,
    hidden_size=48,
    intermediate_size=64,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=0,
)


def _pool_with_sequences(
    lens: list[int], segments: tuple[int, ...] = (6, 8, 7), dtype: torch.dtype = torch.float32, cfg=CFG
) -> tuple[KVPool, list[list[int]]]:
    """A pool of several segments, random K/V, and one block table per sequence spread over the segments."""
    torch.manual_seed(1)
    pool = KVPool(cfg, block_size=4, dtype=dtype)
    for n in segments:
        pool.add_segment(n)
    for seg in pool.segments:
        seg.kv.copy_(torch.randn_like(seg.kv))
    tables = []
    for n in lens:
        blocks = pool.allocate((n + 3) // 4)
        assert blocks is not None
        tables.append(blocks)
    return pool, tables


def _attention(pool, tables, lens, q, use_kernel: bool, monkeypatch) -> torch.Tensor:
    """Decode attention through the plan: the C++ op or the torch reference path."""
    if not use_kernel:
        monkeypatch.setattr(attention, "decode_kernel_op", lambda kv_dtype, on_cuda: None)
    seqs = [
        attention.SeqSlice(start=i, q_len=1, ctx_len=n, block_table=t) for i, (n, t) in enumerate(zip(lens, tables))
    ]
    plan = attention.AttentionPlan(pool, seqs)
    assert (plan.decode_kernel is not None) == use_kernel
    layer = 1
    # The new token's K/V: what the pool already holds at its slot, so both paths see the same cache.
    kv = [pool.segment_of(t[(n - 1) // 4]) for t, n in zip(tables, lens)]
    k = torch.stack([s.kv[layer, 0, (t[(n - 1) // 4] - s.base) * 4 + (n - 1) % 4] for s, t, n in zip(kv, tables, lens)])
    v = torch.stack([s.kv[layer, 1, (t[(n - 1) // 4] - s.base) * 4 + (n - 1) % 4] for s, t, n in zip(kv, tables, lens)])
    out = paged_attention.paged_attention(q, k, v, layer, plan)
    monkeypatch.undo()
    return out


KV_DTYPES = [torch.float32, torch.float16]  # the pool's storage; compute stays fp32


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_attention_matches_torch_across_segments_and_lengths(monkeypatch, kv_dtype):
    lens = [1, 5, 17, 9, 30]
    pool, tables = _pool_with_sequences(lens, dtype=kv_dtype)
    assert len({pool.segment_of(b).base for t in tables for b in t}) > 1  # the test spans segments
    q = torch.randn(len(lens), CFG.num_heads, CFG.head_dim)
    got = _attention(pool, tables, lens, q, True, monkeypatch)
    ref = _attention(pool, tables, lens, q, False, monkeypatch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_attention_of_a_sequence_does_not_depend_on_the_batch(monkeypatch):
    lens = [3, 11, 26]
    pool, tables = _pool_with_sequences(lens)
    q = torch.randn(len(lens), CFG.num_heads, CFG.head_dim)
    batched = _attention(pool, tables, lens, q, True, monkeypatch)
    for i in range(len(lens)):
        alone = _attention(pool, [tables[i]], [lens[i]], q[i : i + 1], True, monkeypatch)
        assert torch.equal(alone, batched[i : i + 1])


@needs_kernels
@pytest.mark.parametrize(
    "kvh,group,d",
    [(3, 3, 64), (2, 3, 136), (2, 2, 6), (1, 9, 64), (1, 1, 64), (2, 2, 64), (1, 4, 64), (1, 5, 40), (1, 8, 72)],
)
def test_decode_attention_matches_float64_for_head_shapes(kvh, group, d):
    # 64: SmolLM2's head; 136, 40, 72: register chunks plus 8-wide tails; groups of 1-4 take the values of every
    # head at once, 5-8 one head at a time; 6 and a group of 9: the scalar path. Lengths: 4 keys per pass and
    # short last passes, and 130 positions for the prefetch ahead.
    g = torch.Generator().manual_seed(d * 10 + group)
    slots, lens = 40, [1, 9, 37, 130]
    segs = [torch.randn(2, 2, slots, kvh, d, generator=g) for _ in range(2)]
    B, H, L = len(lens), kvh * group, max(lens)
    seg_of, slot_of = torch.randint(0, 2, (B, L), generator=g), torch.randint(0, slots, (B, L), generator=g)
    q = torch.randn(B, H, d, generator=g)
    got = ns.paged_decode_attention(q, segs, seg_of, slot_of, torch.tensor(lens), 1, d**-0.5)
    for b, n in enumerate(lens):
        keys = torch.stack([segs[seg_of[b, t]][1, 0, slot_of[b, t]] for t in range(n)]).double()
        vals = torch.stack([segs[seg_of[b, t]][1, 1, slot_of[b, t]] for t in range(n)]).double()
        for h in range(H):
            p = torch.softmax(keys[:, h // group] @ q[b, h].double() * d**-0.5, 0)
            torch.testing.assert_close(got[b, h].double(), p @ vals[:, h // group], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kv_prefetch_changes_no_bit(kv_dtype):
    g = torch.Generator().manual_seed(4)
    lens = [3, 70, 300]
    segs = [torch.randn(2, 2, 64, 3, 64, generator=g).to(kv_dtype) for _ in range(2)]
    seg_of, slot_of = torch.randint(0, 2, (3, 300), generator=g), torch.randint(0, 64, (3, 300), generator=g)
    q = torch.randn(3, 9, 64, generator=g)
    previous = ns.kv_prefetch(0)
    try:
        off = ns.paged_decode_attention(q, segs, seg_of, slot_of, torch.tensor(lens), 1, 0.125)
        assert ns.kv_prefetch(1) == 0
        on = ns.paged_decode_attention(q, segs, seg_of, slot_of, torch.tensor(lens), 1, 0.125)
    finally:
        ns.kv_prefetch(previous)
    assert torch.equal(off, on)
    with pytest.raises(RuntimeError, match="kv_prefetch: 0"):
        ns.kv_prefetch(2)


@needs_kernels
def test_decode_attention_rejects_out_of_pool_slots():
    kv = torch.zeros(2, 2, 8, 2, 8)
    q = torch.zeros(1, 6, 8)
    seg, lens = torch.zeros(1, 4, dtype=torch.long), torch.tensor([4])
    with pytest.raises(RuntimeError, match="points outside the pool"):
        ns.paged_decode_attention(q, [kv], seg, torch.tensor([[0, 1, 2, 99]]), lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="length 5 of row 0"):
        ns.paged_decode_attention(q, [kv], seg, torch.zeros(1, 4, dtype=torch.long), torch.tensor([5]), 0, 1.0)
    with pytest.raises(RuntimeError, match="layer 2 out of range"):
        ns.paged_decode_attention(q, [kv], seg, torch.zeros(1, 4, dtype=torch.long), lens, 2, 1.0)
    with pytest.raises(RuntimeError, match="do not group"):
        ns.paged_decode_attention(torch.zeros(1, 5, 8), [kv], seg, torch.zeros(1, 4, dtype=torch.long), lens, 0, 1.0)


def _fused_inputs(lens: list[int], seed: int = 5, cfg=CFG):
    g = torch.Generator().manual_seed(seed)
    B, H, KVH, D = len(lens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=g)
    angles = torch.rand(B, D // 2, generator=g) * 6
    return qkv, angles.cos(), angles.sin()


def _decode_plan(pool, tables, lens):
    seqs = [
        attention.SeqSlice(start=i, q_len=1, ctx_len=n, block_table=t) for i, (n, t) in enumerate(zip(lens, tables))
    ]
    return attention.AttentionPlan(pool, seqs)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_fused_decode_attention_equals_rope_then_pool_write_then_attention(monkeypatch, kv_dtype):
    from plugins.elementwise import apply_rope

    lens, layer = [1, 5, 17, 9, 30], 1
    H, KVH, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    qkv, cos, sin = _fused_inputs(lens)
    # Reference: torch RoPE, the plan's torch pool write (a cast to the pool's dtype), the torch attention, on an
    # identical pool.
    ref_pool, tables = _pool_with_sequences(lens, dtype=kv_dtype)
    monkeypatch.setattr(attention, "decode_kernel_op", lambda kv_dtype, on_cuda: None)
    ref_plan = _decode_plan(ref_pool, tables, lens)
    assert not ref_plan.fused_decode
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
    ref = paged_attention.paged_attention(
        apply_rope(q.view(-1, H, D), cos, sin),
        apply_rope(k.view(-1, KVH, D), cos, sin).to(kv_dtype),
        v.reshape(-1, KVH, D).to(kv_dtype),
        layer,
        ref_plan,
    ).reshape(len(lens), H * D)
    monkeypatch.undo()
    pool, tables2 = _pool_with_sequences(lens, dtype=kv_dtype)
    assert tables2 == tables
    plan = _decode_plan(pool, tables, lens)
    assert plan.fused_decode
    got = paged_attention.decode_attention_qkv(qkv, cos, sin, layer, plan, H)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for seg, ref_seg in zip(pool.segments, ref_pool.segments):  # the same K/V landed in the same slots
        if kv_dtype == torch.float16:  # rounded to nearest like torch's cast (RoPE's fp32 may differ by an ulp)
            torch.testing.assert_close(seg.kv.float(), ref_seg.kv.float(), rtol=1e-3, atol=1e-3)
        else:
            torch.testing.assert_close(seg.kv, ref_seg.kv, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_fused_decode_attention_of_a_sequence_does_not_depend_on_the_batch(kv_dtype):
    lens = [3, 11, 26]
    pool, tables = _pool_with_sequences(lens, dtype=kv_dtype)
    qkv, cos, sin = _fused_inputs(lens)
    batched = paged_attention.decode_attention_qkv(qkv, cos, sin, 0, _decode_plan(pool, tables, lens), CFG.num_heads)
    for i in range(len(lens)):
        r = slice(i, i + 1)
        plan = _decode_plan(pool, [tables[i]], [lens[i]])
        assert torch.equal(
            paged_attention.decode_attention_qkv(qkv[r], cos[r], sin[r], 0, plan, CFG.num_heads), batched[r]
        )


@needs_kernels
def test_fused_decode_attention_rejects_bad_input_before_writing():
    kv = torch.zeros(2, 2, 8, 2, 8)
    qkv, cos, sin = torch.ones(1, (6 + 4) * 8), torch.ones(1, 4), torch.zeros(1, 4)
    seg, lens = torch.zeros(1, 4, dtype=torch.long), torch.tensor([4])
    op = ns.paged_decode_attention_qkv
    with pytest.raises(RuntimeError, match="points outside the pool"):
        op(qkv, cos, sin, [kv], seg, torch.tensor([[0, 1, 2, 99]]), lens, 0, 1.0, 6)
    assert not kv.any()  # nothing was written by the rejected call
    slots = torch.arange(4)[None]
    with pytest.raises(RuntimeError, match=r"qkv \[B, 80\]"):
        op(qkv[:, :-1], cos, sin, [kv], seg, slots, lens, 0, 1.0, 6)
    with pytest.raises(RuntimeError, match=r"cos and sin \[1, 4\]"):
        op(qkv, torch.ones(1, 3), sin, [kv], seg, slots, lens, 0, 1.0, 6)
    with pytest.raises(RuntimeError, match="do not group"):
        op(qkv, cos, sin, [kv], seg, slots, lens, 0, 1.0, 5)
    with pytest.raises(RuntimeError, match="layer 2 out of range"):
        op(qkv, cos, sin, [kv], seg, slots, lens, 2, 1.0, 6)
    assert not kv.any()
    op(qkv, cos, sin, [kv], seg, slots, lens, 1, 1.0, 6)
    assert kv[1, :, 3].eq(1).all() and not kv[0].any()  # the new token's K (cos 1, sin 0) and V, at slot 3 of layer 1


@needs_kernels
def test_layer_gives_the_same_output_through_the_fused_and_the_torch_decode_paths():
    from trtllm_backend.layers import LayerSlot, dense_layer

    lens = [4, 13, 22]
    g = torch.Generator().manual_seed(11)
    hid = CFG.hidden_size
    t = random_layer_tensors(CFG, g)
    slot = LayerSlot(1, CFG, dense_layer(t, torch.float32))
    h = torch.randn(len(lens), hid, generator=g)
    _, cos, sin = _fused_inputs(lens)
    outs = []
    for fused in (True, False):
        pool, tables = _pool_with_sequences(lens)
        plan = _decode_plan(pool, tables, lens)
        assert plan.fused_decode
        plan.fused_decode = fused  # False: torch RoPE + pool write, then the plain decode op
        outs.append(slot.forward(h, cos, sin, plan))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_disabled_kernels_fall_back_with_a_reason(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_ops", {})
    monkeypatch.setenv("MORPHSERVE_CPU_KERNELS", "0")
    with caplog.at_level("WARNING"):
        assert cpu_kernels.ops() is None
    assert "MORPHSERVE_CPU_KERNELS=0" in caplog.text
    x, w = torch.randn(2, 32), torch.randn(4, 32)
    torch.testing.assert_close(skinny_gemm.linear(x, w), F.linear(x, w))
