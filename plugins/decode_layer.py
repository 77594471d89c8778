"""The decoder layers of a pure decode step as one C++ call (csrc/decode_layer.cpp).

The per-op path makes ~9 torch.ops calls per layer and step, each with dispatcher overhead and, when it goes
parallel, an OpenMP fork and join; the fused op runs all the step's layers in one OpenMP region with barriers
between their phases, on the same inner loops, so its output is bitwise the per-op path's. It applies where every linear is
dense (fp32, fp16- or bf16-stored weights) or INT4 on the C++ kernels, activations are fp32 and the batch is within
the skinny kernels' rows (`skinny_gemm.MAX_ROWS`); elsewhere (INT8 layers, CUDA, no kernels, prefill and
mixed steps) that layer runs op by op (trtllm_backend.layers.run_layers fuses the runs of layers between). `MORPHSERVE_FUSED_DECODE=0` turns it off (the per-op path, for A/B).
"""

from __future__ import annotations

import os

import torch

from . import cpu_kernels, skinny_gemm

DENSE, INT4 = 0, 1  # linear kinds of the op's `meta`
_EMPTY = torch.empty(0)


def enabled() -> bool:
    return os.environ.get("MORPHSERVE_FUSED_DECODE", "1") != "0"


def dense_args(weight: torch.Tensor) -> tuple[list[torch.Tensor], list[int]] | None:
    """A dense linear's part of the op's arguments, or None where the op cannot run it."""
    if (
        weight.is_cuda
        or weight.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or not weight.is_contiguous()
    ):
        return None
    if weight.dtype == torch.bfloat16 and not skinny_gemm.bf16_kernel_available():
        return None
    return [weight, _EMPTY, _EMPTY], [DENSE, weight.shape[0], 0]


def layer_args(input_norm: torch.Tensor, post_norm: torch.Tensor, linears) -> tuple[list, list] | None:
    """(tensors, meta) of a layer for `decode_layers`, or None when the layer cannot be fused. `linears`: qkv,
    o, gate_up, down, each with a `fused_args()` (None when it cannot be fused)."""
    if cpu_kernels.ops() is None or input_norm.dtype != torch.float32 or input_norm.is_cuda:
        return None
    tensors, meta = [input_norm, post_norm], []
    for op in linears:
        part = getattr(op, "fused_args", lambda: None)()
        if part is None:
            return None
        tensors += part[0]
        meta += part[1]
    return tensors, meta


def applies(h: torch.Tensor) -> bool:
    """Whether this step's activations can take the fused op (read per call, so the switch acts at once)."""
    return (
        enabled() and h.dtype == torch.float32 and h.dim() == 2 and not h.is_cuda and h.shape[0] <= skinny_gemm.MAX_ROWS
    )


def _flatten(layers: list[tuple[int, tuple[list, list]]]) -> tuple[list, list, list]:
    return ([t for _, (ts, _) in layers for t in ts], [m for _, (_, ms) in layers for m in ms], [i for i, _ in layers])


class RunCache:
    """The op's flattened arguments per run of layers, kept until a layer of the model is rebound (`clear`):
    flattening 30 layers' 420 tensors and 360 ints cost ~80 us a step. A run is named by its layer indices,
    whose arguments change only with a rebind."""

    __slots__ = ("_flat",)

    def __init__(self):
        self._flat: dict[tuple[int, ...], tuple[list, list, list]] = {}

    def clear(self) -> None:
        self._flat.clear()

    def flat(self, layers: list[tuple[int, tuple[list, list]]]) -> tuple[list, list, list]:
        key = tuple(i for i, _ in layers)
        got = self._flat.get(key)
        if got is None:
            got = self._flat[key] = _flatten(layers)
        return got


def decode_layers(
    h: torch.Tensor,
    layers: list[tuple[int, tuple[list, list]]],
    cos: torch.Tensor,
    sin: torch.Tensor,
    plan,
    num_heads: int,
    eps: float,
    cache: RunCache | None = None,
) -> torch.Tensor:
    """h [B, hidden] -> h [B, hidden] through `layers` ((pool layer index, `layer_args`) each, in order) for a
    pure decode step (`plan.fused_decode`); writes each layer's new K/V. `cache`: the model's RunCache."""
    _, segments, segment_of, slot_of, lens = plan.decode_kernel
    tensors, meta, indices = _flatten(layers) if cache is None else cache.flat(layers)
    return cpu_kernels.ops().decode_layers(
        h, tensors, meta, indices, cos, sin, segments, segment_of, slot_of, lens, plan.head_dim**-0.5, num_heads, eps
    )
