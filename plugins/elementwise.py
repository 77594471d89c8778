"""A decoder layer's row-wise ops: RMSNorm, the residual add fused with the next RMSNorm, SwiGLU's silu * up,
RoPE on a prefill chunk's q|k heads.

On the CPU with fp32 activations they run as single C++ calls (csrc/layer_elementwise.cpp): torch's versions
cost 5-35 us each in dispatch and threading at decode sizes, for well under 1 us of arithmetic. Elsewhere
(CUDA, other dtypes, kernels not built) they are the torch ops, which are also the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels


def _kernels_for(*tensors: torch.Tensor):
    """The C++ namespace when every tensor is an fp32 CPU tensor (activations 2-D), else None."""
    for t in tensors:
        if t.dtype != torch.float32 or t.is_cuda:
            return None
    return cpu_kernels.ops() if tensors[0].dim() == 2 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (ns := _kernels_for(x, weight)) is not None:
        return ns.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual stream and the next sublayer's input."""
    if (ns := _kernels_for(h, delta, weight)) is not None:
        return ns.add_rms_norm(h, delta, weight, eps)
    h = h + delta
    return h, F.rms_norm(h, (h.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (the fused gate | up projection) -> silu(gate) * up [T, I]."""
    if (ns := _kernels_for(gate_up)) is not None:
        return ns.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, >= heads * head_dim] (q then k heads first), cos/sin [T, head_dim/2] -> those heads with half-split
    RoPE (HF layout), [T, heads, head_dim]; the C++ op gives the torch version's bits in one pass."""
    if (ns := _kernels_for(qkv, cos, sin)) is not None:
        return ns.rope_heads(qkv, cos, sin, heads)
    return apply_rope(qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim), cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE (HF layout) in torch. x [T, heads, D], cos/sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
