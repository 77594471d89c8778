"""plugins.token_bitmask: the C++ bitmask fill against the numpy reference (every word pattern, tails, row subsets,
NaN and infinities kept where allowed), and bad input."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels, token_bitmask

ns = cpu_kernels.ops()
needs_kernels = pytest.mark.skipif(
    ns is None, reason=f"C++ kernels unavailable: {cpu_kernels.unsupported_reason() or 'not built: run make setup'}"
)


def _bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    w = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64)
    kind = torch.randint(0, 4, (rows, words), generator=g)
    w[kind == 0] = 0  # all forbidden
    w[kind == 1] = -1  # all allowed
    w[:, ::5] &= ~0xFF  # a forbidden byte beside random ones
    w[:, 1::7] |= 0xFF00  # an allowed byte
    return w.to(torch.int32).contiguous()


def _logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g)
    x[0, ::97] = float("nan")
    x[-1, 3::89] = float("inf")
    return x


@needs_kernels
@pytest.mark.parametrize(
    "batch,vocab,rows",
    [(16, 49152, list(range(16))), (5, 49157, [4, 0, 2]), (3, 40, [1]), (2, 7, [0, 1]), (4, 32, [3, 2, 1, 0])],
)
def test_kernel_gives_the_references_logits(batch, vocab, rows):
    bitmask = _bitmask(len(rows), vocab, seed=vocab)
    want, got = _logits(batch, vocab, seed=1), _logits(batch, vocab, seed=1)
    token_bitmask.reference_apply_(want, bitmask, rows)
    token_bitmask.apply_token_bitmask_(got, bitmask, rows)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(want, nan=0.0))
    assert torch.isneginf(got).any() and not torch.isneginf(got[[r for r in range(batch) if r not in rows]]).any()


def test_reference_reads_bits_little_endian():
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[0b101, 1 << 7]], dtype=torch.int32)  # tokens 0, 2 and 39 allowed
    token_bitmask.apply_token_bitmask_(logits, bitmask, [0])
    allowed = torch.isfinite(logits[0]).nonzero().view(-1).tolist()
    assert allowed == [0, 2, 39]


def test_nothing_to_mask_changes_nothing():
    logits = torch.randn(2, 64)
    before = logits.clone()
    token_bitmask.apply_token_bitmask_(logits, torch.empty(0, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)


@needs_kernels
def test_kernel_refuses_bad_input():
    logits, bitmask = torch.zeros(2, 64), torch.full((1, 2), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        ns.apply_token_bitmask_(logits, bitmask, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="cannot cover"):
        ns.apply_token_bitmask_(torch.zeros(1, 65), bitmask, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="fp32"):
        ns.apply_token_bitmask_(logits.double(), bitmask, torch.tensor([0]))
