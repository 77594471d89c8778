"""The CPU reference: the model in plain fp32 torch, read straight from the fragment files.

It shares no code with the engine's runtime (no slots, no paged KV, no kernels): a forward over a whole sequence with
causal attention, and greedy runs that keep each layer's K/V in plain tensors. A layer's INT4 fragment runs as its dequantized weights (the grid times the stored
scales and zeros, its norms as stored), which is what an exact INT4 kernel computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from plugins.quant_matmul import dequantize_int4
from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision


def _layer(manifest: Manifest, index: int, precision: str) -> dict[str, torch.Tensor]:
    c = manifest.config
    t = load_file(manifest.verified_path(manifest.fragment(index, precision)))
    norms = {n: t[n + ".weight"].float() for n in ("input_layernorm", "post_attention_layernorm")}
    if precision == Precision.FULL:
        return {**norms, **{k.split(".")[1]: t[k].float() for k in t if k.endswith("proj.weight")}}
    if precision != Precision.INT4:
        raise ValueError(f"the reference runs full and int4 layers, not {precision}")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    wq, wk, wv = dequantize_int4(t, "qkv.").split([q, kv, kv])
    gate, up = dequantize_int4(t, "gate_up.").chunk(2)
    return {
        **norms,
        "q_proj": wq,
        "k_proj": wk,
        "v_proj": wv,
        "o_proj": dequantize_int4(t, "o."),
        "gate_proj": gate,
        "up_proj": up,
        "down_proj": dequantize_int4(t, "down."),
    }


class Reference:
    def __init__(self, fragment_dir, precision: str = Precision.FULL):
        self.manifest = m = Manifest(fragment_dir)
        self.config = c = m.config
        shared = {k: v.float() for k, v in load_file(m.verified_path(m.data["shared"])).items()}
        self.embed, self.norm = shared["model.embed_tokens.weight"], shared["model.norm.weight"]
        self.head = shared.get("lm_head.weight", self.embed)
        self.layers = [_layer(m, i, precision) for i in range(c.num_layers)]
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        self._inv_freq = inv

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * w

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [..., heads, T, D], half-split rotation (HF Llama) at positions start..start+T-1."""
        pos = torch.arange(start, start + x.shape[-2], dtype=torch.float64)
        angles = torch.outer(pos, self._inv_freq)
        cos, sin = angles.cos().float(), angles.sin().float()
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @torch.inference_mode()
    def _forward(self, batch: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of tokens [B, T] that follow what `cache` holds (a list of per-layer (K, V), extended
        in place; None or empty: from position 0). With a cache, either T is the whole prompt or a single token."""
        c = self.config
        B, T = batch.shape
        start = cache[0][0].shape[2] if cache else 0
        h = self.embed[batch]
        heads = lambda x, n: x.view(B, T, n, c.head_dim).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        for i, w in enumerate(self.layers):
            x = self._rms(h, w["input_layernorm"])
            q = self._rope(heads(x @ w["q_proj"].T, c.num_heads), start)
            k = self._rope(heads(x @ w["k_proj"].T, c.num_kv_heads), start).repeat_interleave(rep, 1)
            v = heads(x @ w["v_proj"].T, c.num_kv_heads).repeat_interleave(rep, 1)
            if cache is not None:
                if start:
                    k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
                    cache[i] = (k, v)
                else:
                    cache.append((k, v))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0)
            h = h + attn.transpose(1, 2).reshape(B, T, -1) @ w["o_proj"].T
            x = self._rms(h, w["post_attention_layernorm"])
            h = h + (F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T
        return self._rms(h, self.norm) @ self.head.T

    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of every position of `ids`, in one pass."""
        return self._forward(torch.tensor([ids]))[0]

    def greedy(self, ids: torch.Tensor, n: int, banned: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """n greedy tokens after each row of `ids` [B, T], never one of `banned` (the end-of-sequence ids a request
        ignores), and the gap between the top two logits at each: two [B, n] tensors."""
        cache: list = []
        step, tokens, gaps = ids, [], []
        for _ in range(n):
            row = self._forward(step, cache)[:, -1].clone()
            row[:, banned] = float("-inf")
            top = row.topk(2, dim=-1)
            step = top.indices[:, :1]
            tokens.append(step)
            gaps.append(top.values[:, 0] - top.values[:, 1])
        return torch.cat(tokens, 1), torch.stack(gaps, 1)
