"""Attention planning: an iteration's block tables -> the slots each layer's attention reads and writes.

The engine flattens every scheduled token of an iteration into one [T, ...] batch so the matmuls run once;
only attention is per sequence group: all decode sequences (one new token each) in one padded, masked group,
and each prefill chunk on its own (causal, with earlier context gathered from the pool when there is some).
The plan is built once per iteration and reused by every layer; the kernels that consume it are in
plugins.paged_attention and know nothing of blocks or segments, only of the tensors and slots planned here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.paged_attention import decode_kernel_op

from .kv_cache import KVPool, SlotPiece


@dataclass(slots=True)
class SeqSlice:
    start: int  # first row of this sequence's new tokens in the flattened batch
    q_len: int  # new tokens this iteration
    ctx_len: int  # tokens in the cache after this iteration (earlier context + new)
    block_table: list[int]


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Global slot ids of positions [start, end) of one sequence (plain ints: a plan has a few thousand, and
    building them in Python costs less than a chain of small torch ops per sequence)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


# Above this many positions the decode slot table is built with torch ops. Right after a forward has streamed
# the weights through the caches every distinct torch call misses (~100 us for a tiny torch.tensor, against
# ~3 us warm), so the per-position loop stays cheaper up to here (cold: 16 x 40 positions 0.13 ms in Python,
# 0.19 ms in torch; 16 x 200, 0.37 vs 0.21 ms; 16 x 1000, 1.6 vs 0.35 ms).
SLOT_LOOP_MAX = 2048


def _decode_slots(dec: list[SeqSlice], L: int, bs: int, lens: torch.Tensor) -> torch.Tensor:
    """[B, L] global slots of every cached position of each decode sequence; padding positions (past a
    sequence's context) read its own first slot (always valid) and are masked out."""
    if len(dec) * L <= SLOT_LOOP_MAX:
        rows = []
        for s in dec:
            row = _slots(s.block_table, 0, s.ctx_len, bs)
            rows.append(row + row[:1] * (L - s.ctx_len))
        return torch.tensor(rows, dtype=torch.long)
    nb = -(-L // bs)
    tables = [s.block_table[:nb] + s.block_table[:1] * (nb - min(nb, len(s.block_table))) for s in dec]
    offsets = torch.arange(bs, dtype=torch.long)
    slots = (torch.tensor(tables, dtype=torch.long)[:, :, None] * bs + offsets).view(len(dec), nb * bs)[:, :L]
    if min(s.ctx_len for s in dec) == L:
        return slots.contiguous()
    return torch.where(torch.arange(L)[None, :] >= lens[:, None], slots[:, :1], slots)


def _decode_locations(pool: KVPool, dec: list[SeqSlice], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment index, slot within the segment) [B, L] of every cached position of each decode sequence, built
    in Python as one tensor (what `_decode_slots` + `KVPool.locate_slots` give, in one torch call instead of
    three to five: each one misses the caches right after a forward); padding reads the sequence's first slot."""
    bs = pool.block_size
    bounds = [(seg.base, seg.base + seg.num_blocks, i) for i, seg in enumerate(pool.segments)]
    where, local = [], []
    for s in dec:
        seg_row, slot_row = [], []
        for block in s.block_table[: -(-s.ctx_len // bs)]:
            for lo, hi, i in bounds:
                if lo <= block < hi:
                    break
            else:
                raise KeyError(f"block {block} belongs to no segment")
            first = (block - lo) * bs
            seg_row += [i] * bs
            slot_row += range(first, first + bs)
        pad = L - s.ctx_len
        where.append(seg_row[: s.ctx_len] + seg_row[:1] * pad)
        local.append(slot_row[: s.ctx_len] + slot_row[:1] * pad)
    segment_of, slot_of = torch.tensor([where, local], dtype=torch.long).unbind(0)
    return segment_of, slot_of


class AttentionPlan:
    """What plugins.paged_attention reads: `write`, the decode group (`decode_*`, `fused_decode`), `prefills`,
    `kv_dtype` and `head_dim`."""

    def __init__(self, pool: KVPool, seqs: list[SeqSlice]):
        bs = pool.block_size
        self.kv_dtype = pool.dtype
        self.head_dim = pool.config.head_dim
        self.num_tokens = sum(s.q_len for s in seqs)
        # Where each new token's K/V goes.
        self._write_slots = [slot for s in seqs for slot in _slots(s.block_table, s.ctx_len - s.q_len, s.ctx_len, bs)]
        self._pool = pool
        self._write: list[SlotPiece] | None = None
        # Decode group: one new token per sequence, keys padded to the longest context and masked.
        dec = [s for s in seqs if s.q_len == 1]
        self._decode_starts = [s.start for s in dec]
        self._decode_rows: torch.Tensor | None = None
        self.decode_len = max((s.ctx_len for s in dec), default=0)
        self.decode_gather: list[SlotPiece] = []
        self.decode_mask: torch.Tensor | None = None
        # For the C++ op: (op, segment tensors, segment of each position [B, L], local slot [B, L], lengths [B]).
        self.decode_kernel: tuple | None = None
        # Decode rows are exactly 0..T-1 (a pure decode step): the op's output is the whole attention output.
        self.decode_only = len(dec) == len(seqs) and all(s.start == i for i, s in enumerate(dec))
        # Pure decode on the C++ path: the fused layers (plugins.decode_layer), or a layer's decode_attention_qkv
        # (RoPE, K/V write and attention in one op).
        self.fused_decode = False
        if dec:
            L = self.decode_len
            lens = torch.tensor([s.ctx_len for s in dec])
            op = decode_kernel_op(pool.dtype, pool.segments[0].kv.is_cuda)
            if op is not None:
                # small plans: located in Python, one torch call; larger ones with torch ops on the slot table
                where = (
                    _decode_locations(pool, dec, L)
                    if len(dec) * L <= SLOT_LOOP_MAX
                    else pool.locate_slots(_decode_slots(dec, L, bs, lens))
                )
                self.decode_kernel = (op, [seg.kv for seg in pool.segments], *where, lens)
                self.fused_decode = self.decode_only
            else:
                slots = _decode_slots(dec, L, bs, lens)
                self.decode_gather = pool.split_slots(slots.flatten())
                valid = torch.arange(L)[None, :] < lens[:, None]
                self.decode_mask = None if bool(valid.all()) else valid[:, None, None, :]
        # Prefill chunks: causal over new tokens, plus earlier context read back from the pool.
        self.prefills: list[tuple[SeqSlice, list[SlotPiece] | None, torch.Tensor | None]] = []
        for s in seqs:
            if s.q_len == 1:
                continue
            if s.ctx_len == s.q_len:
                self.prefills.append((s, None, None))
            else:
                gather = pool.split_slots(torch.tensor(_slots(s.block_table, 0, s.ctx_len, bs), dtype=torch.long))
                q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len)
                mask = torch.arange(s.ctx_len)[None, :] <= q_pos[:, None]
                self.prefills.append((s, gather, mask))

    @property
    def decode_rows(self) -> torch.Tensor:
        """Rows of the decode sequences in the flattened batch (built on first use: the fused decode step
        never asks)."""
        if self._decode_rows is None:
            self._decode_rows = torch.tensor(self._decode_starts, dtype=torch.long)
        return self._decode_rows

    @property
    def write(self) -> list[SlotPiece]:
        """Where each new token's K/V goes, split by segment (built on first use: a fused decode step writes
        inside its C++ op and never asks)."""
        if self._write is None:
            self._write = self._pool.split_slots(torch.tensor(self._write_slots, dtype=torch.long))
        return self._write
