"""Paged attention kernels and their dispatch (torch, CPU; the same code runs on CUDA tensors).

They run an attention plan (trtllm_backend.attention builds it from the block tables): K/V slots already split
by KV segment tensor, the decode group padded and masked in one SDPA, each prefill chunk on its own. The pool
may hold K/V in a narrower dtype than q (fp16 beside fp32 compute on the CPU): what is read back is widened to
q's dtype, so the arithmetic stays in the compute dtype. This
module knows no engine type; a plan is anything with the attributes `paged_attention` reads, and a slot
access is a list of pieces (segment tensor [layers, 2, slots, KVH, D], rows it serves or None for all, local
slots). On the CPU with an fp32 or fp16 pool the decode group runs in one C++ op (csrc/paged_decode_attention.cpp)
that reads K/V in place from the segments; in a pure decode step that op also applies RoPE and writes the new K/V (`decode_attention_qkv`). Elsewhere, or without
the built kernels, it is the torch path below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels


def decode_kernel_op(kv_dtype: torch.dtype, on_cuda: bool):
    """The C++ decode attention op where it applies (CPU, fp32 or fp16 pool, kernels built), else None."""
    if kv_dtype not in (torch.float32, torch.float16) or on_cuda:
        return None
    ns = cpu_kernels.ops()
    return None if ns is None else ns.paged_decode_attention


def _gather(pieces: list[tuple], layer: int, kv_index: int, n: int) -> torch.Tensor:
    first = pieces[0]
    if first[1] is None:
        return first[0][layer, kv_index].index_select(0, first[2])
    src = first[0][layer, kv_index]
    out = torch.empty((n,) + tuple(src.shape[1:]), dtype=src.dtype)
    for kv, rows, local in pieces:
        out.index_copy_(0, rows, kv[layer, kv_index].index_select(0, local))
    return out


def decode_attention_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, plan, num_heads: int
) -> torch.Tensor:
    """A pure decode step (`plan.fused_decode`): qkv [B, (H + 2 KVH) * D] from the fused projection, cos/sin
    [B, D/2] -> attention output [B, H * D]; RoPE and the pool write of the new K/V happen inside the op."""
    _, segments, segment_of, slot_of, lens = plan.decode_kernel
    return cpu_kernels.ops().paged_decode_attention_qkv(
        qkv, cos, sin, segments, segment_of, slot_of, lens, layer, plan.head_dim**-0.5, num_heads
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, plan) -> torch.Tensor:
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
        keys = _gather(plan.decode_gather, layer, 0, B * L).to(q.dtype).view(B, L, -1, D).transpose(1, 2)
        vals = _gather(plan.decode_gather, layer, 1, B * L).to(q.dtype).view(B, L, -1, D).transpose(1, 2)
        qd = q.index_select(0, plan.decode_rows)[:, :, None, :]  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=plan.decode_mask, enable_gqa=True)
        out.index_copy_(0, plan.decode_rows, o[:, :, 0, :])
    for s, gather, mask in plan.prefills:
        sl = slice(s.start, s.start + s.q_len)
        qs = q[sl].transpose(0, 1)[None]  # [1, H, q, D]
        if gather is None:
            ks, vs = k[sl].to(q.dtype).transpose(0, 1)[None], v[sl].to(q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = _gather(gather, layer, 0, s.ctx_len).to(q.dtype).transpose(0, 1)[None]
            vs = _gather(gather, layer, 1, s.ctx_len).to(q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
    return out
