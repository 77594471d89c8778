"""plugins.elementwise: the C++ row-wise layer ops against torch's, batch independence, bad input, fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugins import cpu_kernels, elementwise

ns = cpu_kernels.ops()
needs_kernels = pytest.mark.skipif(
    ns is None, reason=f"C++ kernels unavailable: {cpu_kernels.unsupported_reason() or 'not built: run make setup'}"
)
EPS = 1e-5


def _ref_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _ref_silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# (rows, features): decode sizes, tails that are not a multiple of 8, and a prefill size split over threads.
SHAPES = [(1, 576), (3, 13), (5, 1536), (70, 1536)]


@needs_kernels
@pytest.mark.parametrize("m,n", SHAPES)
def test_rms_norm_matches_torch(m, n):
    g = torch.Generator().manual_seed(m + n)
    x, w = torch.randn(m, n, generator=g) * 3, torch.randn(n, generator=g)
    torch.testing.assert_close(ns.rms_norm(x, w, EPS), _ref_rms_norm(x, w), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m,n", SHAPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(m, n):
    g = torch.Generator().manual_seed(m * n)
    h, d, w = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g), torch.randn(n, generator=g)
    total, normed = ns.add_rms_norm(h, d, w, EPS)
    assert torch.equal(total, h + d)
    torch.testing.assert_close(normed, _ref_rms_norm(h + d, w), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m,n", SHAPES)
def test_silu_mul_matches_torch(m, n):
    g = torch.Generator().manual_seed(7 * m + n)
    gu = torch.randn(m, 2 * n, generator=g) * 4
    torch.testing.assert_close(ns.silu_mul(gu), _ref_silu_mul(gu), rtol=3e-6, atol=1e-6)


@needs_kernels
def test_silu_mul_saturates_like_torch_at_extreme_gates():
    # The vector exp clamps its input; silu must still give g for large g and ~0 for very negative g.
    gate = torch.tensor([[-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4, 1e30]])
    gu = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    got = ns.silu_mul(gu)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _ref_silu_mul(gu), rtol=1e-6, atol=1e-30)


@needs_kernels
def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, d, w = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    gu = torch.randn(9, 3072, generator=g)
    norm, (_, sn), act = ns.rms_norm(x, w, EPS), ns.add_rms_norm(x, d, w, EPS), ns.silu_mul(gu)
    for i in range(9):
        r = slice(i, i + 1)
        assert torch.equal(ns.rms_norm(x[r], w, EPS), norm[r])
        assert torch.equal(ns.add_rms_norm(x[r], d[r], w, EPS)[1], sn[r])
        assert torch.equal(ns.silu_mul(gu[r]), act[r])


@needs_kernels
def test_strided_input_is_accepted():
    x, w = torch.randn(4, 1152)[:, ::2], torch.randn(576)
    torch.testing.assert_close(ns.rms_norm(x, w, EPS), _ref_rms_norm(x, w), rtol=1e-5, atol=1e-5)
    gu = torch.randn(6, 4).t()
    torch.testing.assert_close(ns.silu_mul(gu), _ref_silu_mul(gu), rtol=3e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: ns.rms_norm(torch.randn(2, 8).double(), torch.randn(8), EPS), "rms_norm: input must be a 2-D fp32"),
        (lambda: ns.rms_norm(torch.randn(8), torch.randn(8), EPS), "rms_norm: input must be a 2-D fp32"),
        (lambda: ns.rms_norm(torch.randn(2, 8), torch.randn(9), EPS), "weight must be a contiguous fp32 vector of 8"),
        (lambda: ns.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), EPS), "differ in shape"),
        (lambda: ns.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).half(), torch.randn(8), EPS), "delta must be"),
        (lambda: ns.silu_mul(torch.randn(2, 7)), "odd number of features"),
        (lambda: ns.silu_mul(torch.randn(2, 8, 2)), "gate_up must be a 2-D fp32"),
    ],
)
def test_bad_input_is_rejected_by_name(bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad()


def test_dispatch_falls_back_to_torch_off_the_kernel_path(monkeypatch):
    x, w = torch.randn(3, 16), torch.randn(16)
    gu = torch.randn(3, 32)
    # bf16 activations never reach the fp32 kernels.
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(elementwise.rms_norm(xb, wb, EPS), F.rms_norm(xb, (16,), wb, EPS))
    # Kernels disabled: the torch ops, same values.
    monkeypatch.setattr(cpu_kernels, "_ops", {"ns": None})
    torch.testing.assert_close(elementwise.rms_norm(x, w, EPS), _ref_rms_norm(x, w))
    h, n = elementwise.add_rms_norm(x, x, w, EPS)
    torch.testing.assert_close(h, 2 * x)
    torch.testing.assert_close(n, _ref_rms_norm(2 * x, w))
    torch.testing.assert_close(elementwise.silu_mul(gu), _ref_silu_mul(gu))


@needs_kernels
def test_dispatch_uses_the_kernels_for_fp32_cpu_rows(monkeypatch):
    calls = []
    real = cpu_kernels.ops()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_kernels, "_ops", {"ns": Spy()})
    x, w = torch.randn(2, 16), torch.randn(16)
    elementwise.rms_norm(x, w, EPS)
    elementwise.add_rms_norm(x, x, w, EPS)
    elementwise.silu_mul(torch.randn(2, 32))
    assert calls == ["rms_norm", "add_rms_norm", "silu_mul"]


# (tokens, q|k heads, head_dim, extra v columns): SmolLM2's prefill chunk (9 + 3 heads of 64), a head whose half
# is not a multiple of 8, one token.
ROPE_SHAPES = [(512, 12, 64, 192), (7, 3, 12, 24), (1, 2, 64, 0)]


@needs_kernels
@pytest.mark.parametrize("t,heads,d,extra", ROPE_SHAPES)
def test_rope_heads_gives_torchs_bits(t, heads, d, extra):
    g = torch.Generator().manual_seed(t + heads + d)
    qkv = torch.randn(t, heads * d + extra, generator=g) * 4
    angle = torch.randn(t, d // 2, generator=g) * 30
    cos, sin = angle.cos(), angle.sin()
    got = ns.rope_heads(qkv, cos, sin, heads)
    ref = elementwise.apply_rope(qkv[:, : heads * d].view(t, heads, d), cos, sin)
    assert got.shape == (t, heads, d)
    assert torch.equal(got, ref)  # no FMA contraction: each product and sum rounded as torch rounds it


def test_rope_heads_falls_back_to_torch_off_the_kernels():
    qkv = torch.randn(4, 3 * 8 + 8, dtype=torch.float64)
    cos, sin = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    ref = elementwise.apply_rope(qkv[:, :24].view(4, 3, 8), cos, sin)
    assert torch.equal(elementwise.rope_heads(qkv, cos, sin, 3, 8), ref)


@needs_kernels
def test_rope_heads_names_a_bad_input():
    qkv, cos = torch.randn(4, 32), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="do not fit a row"):
        ns.rope_heads(qkv, cos, cos, 5)  # 5 heads of 8 > 32 columns
    with pytest.raises(RuntimeError, match="must both be"):
        ns.rope_heads(qkv, cos, torch.randn(3, 4), 2)
    with pytest.raises(RuntimeError, match="fp32"):
        ns.rope_heads(qkv.double(), cos, cos, 2)
