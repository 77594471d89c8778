"""Paged attention over block tables (torch, CPU; the same code runs on CUDA tensors).

The engine flattens every scheduled token of an iteration into one [T, ...] batch so the matmuls run once;
only attention is per sequence group: all decode sequences (one new token each) in one padded, masked SDPA,
and each prefill chunk on its own (causal, with earlier context gathered from the pool when there is some).
The plan is built once per iteration and reused by every layer. On the CPU with an fp32 pool the decode group
runs in one C++ op (csrc/paged_decode_attention.cpp) that reads K/V in place from the segments; in a pure
decode step that op also applies RoPE and writes the new K/V (`decode_attention_qkv`). Elsewhere, or without
the built kernels, it is the torch path below.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtllm_backend.kv_cache import KVPool

from . import cpu_kernels


@dataclass(slots=True)
class SeqSlice:
    start: int  # first row of this sequence's new tokens in the flattened batch
    q_len: int  # new tokens this iteration
    ctx_len: int  # tokens in the cache after this iteration (earlier context + new)
    block_table: list[int]


# One piece of a slot access: (segment tensor, rows of the output/input it serves or None for all, local slots)
Piece = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


def _split_by_segment(pool: KVPool, slots: torch.Tensor) -> list[Piece]:
    """Map global slot ids to (segment, local slot), grouped by segment."""
    bs = pool.block_size
    segs = pool.segments
    if len(segs) == 1:
        return [(segs[0].kv, None, slots - segs[0].base * bs)]
    bounds = torch.tensor([s.base * bs for s in segs[1:]], dtype=slots.dtype)
    which = torch.bucketize(slots, bounds, right=True)
    pieces = []
    for i, seg in enumerate(segs):
        rows = (which == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        if rows.numel() == slots.numel():
            return [(seg.kv, None, slots - seg.base * bs)]
        pieces.append((seg.kv, rows, slots[rows] - seg.base * bs))
    return pieces


def _segment_and_local(pool: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global slot ids -> (segment index, slot within that segment), same shape."""
    starts = torch.tensor([s.base * pool.block_size for s in pool.segments], dtype=torch.long)
    which = torch.bucketize(slots, starts[1:], right=True)
    return which, slots - starts[which]


def _kernel_decode(pool: KVPool):
    """The C++ decode attention op where it applies (CPU, fp32 pool, kernels built), else None."""
    if pool.dtype != torch.float32 or pool.segments[0].kv.is_cuda:
        return None
    ns = cpu_kernels.ops()
    return None if ns is None else ns.paged_decode_attention


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Global slot ids of positions [start, end) of one sequence (plain ints: a plan has a few thousand, and
    building them in Python costs less than a chain of small torch ops per sequence)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class AttentionPlan:
    def __init__(self, pool: KVPool, seqs: list[SeqSlice]):
        bs = pool.block_size
        self.pool = pool
        self.num_tokens = sum(s.q_len for s in seqs)
        # Where each new token's K/V goes.
        write_slots = [slot for s in seqs for slot in _slots(s.block_table, s.ctx_len - s.q_len, s.ctx_len, bs)]
        self.write = _split_by_segment(pool, torch.tensor(write_slots, dtype=torch.long))
        # Decode group: one new token per sequence, keys padded to the longest context and masked.
        dec = [s for s in seqs if s.q_len == 1]
        self.decode_rows = torch.tensor([s.start for s in dec], dtype=torch.long)
        self.decode_len = max((s.ctx_len for s in dec), default=0)
        self.decode_gather: list[Piece] = []
        self.decode_mask: torch.Tensor | None = None
        # For the C++ op: (op, segment tensors, segment of each position [B, L], local slot [B, L], lengths [B]).
        self.decode_kernel: tuple | None = None
        # Decode rows are exactly 0..T-1 (a pure decode step): the op's output is the whole attention output.
        self.decode_only = len(dec) == len(seqs) and all(s.start == i for i, s in enumerate(dec))
        # Pure decode on the C++ path: layers call decode_attention_qkv (RoPE, K/V write and attention in one op).
        self.fused_decode = False
        if dec:
            L = self.decode_len
            lens = torch.tensor([s.ctx_len for s in dec])
            rows = []
            for s in dec:
                row = _slots(s.block_table, 0, s.ctx_len, bs)
                # Padding positions read the sequence's own first slot (always valid) and are masked out.
                rows.append(row + row[:1] * (L - s.ctx_len))
            slots = torch.tensor(rows, dtype=torch.long)
            if (op := _kernel_decode(pool)) is not None:
                self.decode_kernel = (op, [seg.kv for seg in pool.segments], *_segment_and_local(pool, slots), lens)
                self.fused_decode = self.decode_only
            else:
                self.decode_gather = _split_by_segment(pool, slots.flatten())
                valid = torch.arange(L)[None, :] < lens[:, None]
                self.decode_mask = None if bool(valid.all()) else valid[:, None, None, :]
        # Prefill chunks: causal over new tokens, plus earlier context read back from the pool.
        self.prefills: list[tuple[SeqSlice, list[Piece] | None, torch.Tensor | None]] = []
        for s in seqs:
            if s.q_len == 1:
                continue
            if s.ctx_len == s.q_len:
                self.prefills.append((s, None, None))
            else:
                gather = _split_by_segment(pool, torch.tensor(_slots(s.block_table, 0, s.ctx_len, bs), dtype=torch.long))
                q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len)
                mask = torch.arange(s.ctx_len)[None, :] <= q_pos[:, None]
                self.prefills.append((s, gather, mask))


def _gather(pieces: list[Piece], layer: int, kv_index: int, n: int) -> torch.Tensor:
    first = pieces[0]
    if first[1] is None:
        return first[0][layer, kv_index].index_select(0, first[2])
    src = first[0][layer, kv_index]
    out = torch.empty((n,) + tuple(src.shape[1:]), dtype=src.dtype)
    for kv, rows, local in pieces:
        out.index_copy_(0, rows, kv[layer, kv_index].index_select(0, local))
    return out


def decode_attention_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, plan: AttentionPlan,
                         num_heads: int) -> torch.Tensor:
    """A pure decode step (`plan.fused_decode`): qkv [B, (H + 2 KVH) * D] from the fused projection, cos/sin
    [B, D/2] -> attention output [B, H * D]; RoPE and the pool write of the new K/V happen inside the op."""
    _, segments, segment_of, slot_of, lens = plan.decode_kernel
    head_dim = plan.pool.config.head_dim
    return cpu_kernels.ops().paged_decode_attention_qkv(qkv, cos, sin, segments, segment_of, slot_of, lens, layer,
                                                        head_dim**-0.5, num_heads)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, plan: AttentionPlan) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H, D]. Writes k/v to the pool."""
    for kv, rows, local in plan.write:
        kv[layer, 0].index_copy_(0, local, k if rows is None else k[rows])
        kv[layer, 1].index_copy_(0, local, v if rows is None else v[rows])
    T, H, D = q.shape
    if plan.decode_kernel is not None:
        op, segments, segment_of, slot_of, lens = plan.decode_kernel
        if plan.decode_only:
            return op(q, segments, segment_of, slot_of, lens, layer, D**-0.5)
        out = torch.empty_like(q)
        o = op(q.index_select(0, plan.decode_rows), segments, segment_of, slot_of, lens, layer, D**-0.5)
        out.index_copy_(0, plan.decode_rows, o)
    else:
        out = torch.empty_like(q)
    if plan.decode_gather:
        B, L = plan.decode_rows.numel(), plan.decode_len
        keys = _gather(plan.decode_gather, layer, 0, B * L).view(B, L, -1, D).transpose(1, 2)
        vals = _gather(plan.decode_gather, layer, 1, B * L).view(B, L, -1, D).transpose(1, 2)
        qd = q.index_select(0, plan.decode_rows)[:, :, None, :]  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=plan.decode_mask, enable_gqa=True)
        out.index_copy_(0, plan.decode_rows, o[:, :, 0, :])
    for s, gather, mask in plan.prefills:
        sl = slice(s.start, s.start + s.q_len)
        qs = q[sl].transpose(0, 1)[None]  # [1, H, q, D]
        if gather is None:
            ks, vs = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = _gather(gather, layer, 0, s.ctx_len).transpose(0, 1)[None]
            vs = _gather(gather, layer, 1, s.ctx_len).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
    return out
