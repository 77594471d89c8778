"""Decoder layers as slots bound to fragments.

A slot runs whatever fragment it is bound to; swapping precision is rebinding the slot between two
iterations. The layer math (RMSNorm, RoPE, GQA attention, SwiGLU) is the same for every precision: only
the linear operators differ (dense here, INT4/INT8 in plugins.quant_matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins import decode_layer as fused
from plugins import skinny_gemm
from plugins.elementwise import add_rms_norm, rms_norm, rope_heads, silu_mul
from plugins.paged_attention import decode_attention_qkv, paged_attention

from . import huge_pages
from .attention import AttentionPlan
from .manifest import ModelConfig
from .precision import Precision


class DenseLinear:
    """Unquantized weight [out, in]: the compute dtype, or fp16 storage under fp32 compute (skinny_gemm)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()
        # Counted once: the engine reads every layer's bytes each iteration (morph, invariants).
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_gemm.linear(x, self.weight)

    def fused_args(self):
        return fused.dense_args(self.weight)

    def resident_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        (self.weight,) = tensors


@dataclass(slots=True)
class LayerWeights:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    qkv: object  # callables x -> x @ W.T with .nbytes
    o: object
    gate_up: object
    down: object

    @property
    def nbytes(self) -> int:
        norms = self.input_layernorm.numel() * self.input_layernorm.element_size() * 2
        return norms + sum(op.nbytes for op in (self.qkv, self.o, self.gate_up, self.down))

    def pack_on_huge_pages(self) -> "LayerWeights":
        """Move every tensor of the layer into one buffer on 2 MiB pages (trtllm_backend.huge_pages: a layer's
        tensors are too small to fill a page alone); before the layer is bound (the fused calls keep
        pointers)."""
        ops = (self.qkv, self.o, self.gate_up, self.down)
        held = [op.resident_tensors() for op in ops]
        moved = iter(
            huge_pages.pack([self.input_layernorm, self.post_attention_layernorm, *(t for h in held for t in h)])
        )
        self.input_layernorm, self.post_attention_layernorm = next(moved), next(moved)
        for op, h in zip(ops, held):
            op.adopt([next(moved) for _ in h])
        return self


def dense_layer(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, weight_dtype: torch.dtype | None = None
) -> LayerWeights:
    """Full-precision fragment -> weights with q|k|v and gate|up fused (one matmul each); norms in `dtype`,
    matmul weights in `weight_dtype` (default: `dtype`)."""
    t = {k: v.to(dtype if v.dim() == 1 else weight_dtype or dtype) for k, v in tensors.items()}
    return LayerWeights(
        input_layernorm=t["input_layernorm.weight"],
        post_attention_layernorm=t["post_attention_layernorm.weight"],
        qkv=DenseLinear(
            torch.cat([t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"], t["self_attn.v_proj.weight"]])
        ),
        o=DenseLinear(t["self_attn.o_proj.weight"]),
        gate_up=DenseLinear(torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]])),
        down=DenseLinear(t["mlp.down_proj.weight"]),
    )


class LayerSlot:
    """One decoder layer position; `weights` is the fragment it is bound to now."""

    def __init__(
        self,
        index: int,
        config: ModelConfig,
        weights: LayerWeights,
        precision: str = Precision.FULL,
        runs: fused.RunCache | None = None,
    ):
        self.index = index
        self.config = config
        self.weights = weights
        self.precision = precision
        self._fused: tuple | None = None  # fused_args() for `weights`, built on first use
        self._runs = runs  # the model's flattened runs of fused layers, dropped when any layer is rebound

    def bind(self, weights: LayerWeights, precision: str) -> LayerWeights:
        """Rebind to another fragment (engine thread, between iterations); returns the old weights."""
        old, self.weights, self.precision = self.weights, weights, precision
        self._fused = None
        if self._runs is not None:
            self._runs.clear()
        return old

    def fused_args(self) -> tuple[list, list] | None:
        """This layer's arguments for plugins.decode_layer (None: it runs op by op), kept until a rebind."""
        if self._fused is None:
            w = self.weights
            self._fused = (
                fused.layer_args(w.input_layernorm, w.post_attention_layernorm, (w.qkv, w.o, w.gate_up, w.down)),
            )
        return self._fused[0]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """h [T, hidden] -> h [T, hidden]; cos/sin [T, D/2] at each token's position."""
        c, w = self.config, self.weights
        if plan.fused_decode and fused.applies(h) and (args := self.fused_args()) is not None:
            # the whole layer in one call (bitwise the per-op path below)
            return fused.decode_layers(h, [(self.index, args)], cos, sin, plan, c.num_heads, c.rms_norm_eps)
        qkv = w.qkv(rms_norm(h, w.input_layernorm, c.rms_norm_eps))
        if plan.fused_decode:
            attn = decode_attention_qkv(qkv, cos, sin, self.index, plan, c.num_heads)
        else:
            attn = self._attention(qkv, cos, sin, plan).to(h.dtype)
        h, x = add_rms_norm(h, w.o(attn), w.post_attention_layernorm, c.rms_norm_eps)
        return h + w.down(silu_mul(w.gate_up(x)))

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """Torch RoPE and the general paged attention (prefill chunks, mixed steps, no C++ kernels)."""
        c, T = self.config, qkv.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # q and k heads are adjacent in the fused output: one RoPE over both.
        qk = rope_heads(qkv, cos, sin, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, q_dim + kv_dim :].view(T, c.num_kv_heads, c.head_dim)
        return paged_attention(q, k.to(plan.kv_dtype), v.to(plan.kv_dtype), self.index, plan).reshape(T, q_dim)


def run_layers(
    slots: list[LayerSlot],
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    plan: AttentionPlan,
    runs: fused.RunCache | None = None,
) -> torch.Tensor:
    """h through every slot in turn. In a pure decode step that the fused op takes, each run of consecutive
    fusable layers is one C++ call (all of them, unless some layer is INT8); the others run op by op. `runs`:
    the RunCache the slots were made with (their arguments flattened once per binding)."""
    if not (plan.fused_decode and fused.applies(h)):
        for slot in slots:
            h = slot.forward(h, cos, sin, plan)
        return h
    c = slots[0].config
    run: list[tuple[int, tuple]] = []
    for slot in slots:
        if (args := slot.fused_args()) is not None:
            run.append((slot.index, args))
            continue
        if run:
            h = fused.decode_layers(h, run, cos, sin, plan, c.num_heads, c.rms_norm_eps, runs)
            run = []
        h = slot.forward(h, cos, sin, plan)
    return fused.decode_layers(h, run, cos, sin, plan, c.num_heads, c.rms_norm_eps, runs) if run else h
