"""The runtime model driven offline with a chosen set of INT4 layers (profiling, quality evaluation).

Uses the same layer slots and paged attention as serving, so what is measured is what is served.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from plugins.elementwise import rms_norm
from trtllm_backend.attention import AttentionPlan, SeqSlice
from trtllm_backend.fragments import FragmentStore
from trtllm_backend.kv_cache import KVPool
from trtllm_backend.layers import LayerWeights
from trtllm_backend.manifest import Manifest
from trtllm_backend.model import LlamaModel
from trtllm_backend.precision import Precision

BLOCK = 16


class OfflineModel:
    def __init__(
        self,
        fragment_dir: str | Path,
        max_len: int = 1024,
        weight_dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype = torch.float32,
        quantized: str = Precision.INT4,
    ):
        self.manifest = Manifest(fragment_dir)
        # weight_dtype=float16 stores the full-precision weights as the served default does (fp32 compute).
        self.store = FragmentStore(self.manifest, torch.float32, weight_dtype)
        self.model = LlamaModel(self.store, max_len)
        self.config = self.manifest.config
        self.full: list[LayerWeights] = [s.weights for s in self.model.slots]
        # The quantized form set_quantized binds: INT4 (AWQ, the morph rung) or Q4_1 (a GGUF's own blocks).
        self.quantized = Precision(quantized)
        self.int4: list[LayerWeights] = [
            self.store.load_layer(i, self.quantized) for i in range(self.config.num_layers)
        ]
        # kv_dtype=float16 stores K/V as a served kv_cache_dtype=float16 pool does: every attention reads them rounded.
        self.kv_dtype = kv_dtype
        self.pool = KVPool(self.config, BLOCK, kv_dtype)
        # The tied embedding / LM head: its full table and, where the set has one, its INT8 fragment.
        self.head_full = self.model.head.table
        self.head_int8 = self.store.load_head(Precision.INT8) if self.manifest.head_swappable() else None

    def set_head(self, int8: bool) -> None:
        if int8 and self.head_int8 is None:
            raise ValueError(
                f"{self.manifest.dir}: no INT8 lm_head fragment (python -m engines.build_fragments --lm-head-int8)"
            )
        self.model.head.bind(self.head_int8 if int8 else self.head_full, Precision.INT8 if int8 else Precision.FULL)

    def set_quantized(self, layers) -> None:
        q = set(layers)
        for i, slot in enumerate(self.model.slots):
            slot.bind(self.int4[i] if i in q else self.full[i], self.quantized if i in q else Precision.FULL)

    def _hold(self, blocks: int) -> None:
        """A pool of at least `blocks` blocks (a new one when the current is smaller)."""
        if self.pool.num_blocks < blocks:
            self.pool = KVPool(self.config, BLOCK, self.kv_dtype)
            self.pool.add_segment(blocks)

    def _plan(self, batch: int, length: int) -> AttentionPlan:
        need = batch * -(-length // BLOCK)
        self._hold(need)
        per = need // batch
        seqs = [SeqSlice(b * length, length, length, list(range(b * per, (b + 1) * per))) for b in range(batch)]
        return AttentionPlan(self.pool, seqs)

    @torch.inference_mode()
    def layer_inputs(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], AttentionPlan, tuple]:
        """Hidden state entering every layer (and the final one) for ids [B, L] under the current binding."""
        B, L = ids.shape
        plan = self._plan(B, L)
        pos = torch.arange(L).repeat(B)
        cos, sin = self.model.cos[pos], self.model.sin[pos]
        h = self.model.head.embed(ids.flatten()).to(self.model.norm.dtype)
        states = [h]
        for slot in self.model.slots:
            h = slot.forward(h, cos, sin, plan)
            states.append(h)
        return states, plan, (cos, sin)

    @torch.inference_mode()
    def run_layers(self, h: torch.Tensor, start: int, plan: AttentionPlan, rope: tuple) -> torch.Tensor:
        for slot in self.model.slots[start:]:
            h = slot.forward(h, *rope, plan)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.head.logits(rms_norm(h, self.model.norm, self.config.rms_norm_eps))

    @torch.inference_mode()
    def nll(self, ids: torch.Tensor) -> tuple[float, int]:
        """Summed next-token negative log-likelihood and token count for ids [B, L]."""
        states, _, _ = self.layer_inputs(ids)
        logits = self.logits(states[-1]).view(ids.shape[0], ids.shape[1], -1)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        return float(loss), ids[:, 1:].numel()

    @torch.inference_mode()
    def suffix_nll(self, ids: torch.Tensor, prefix_len: int, prefix_layers, suffix_layers) -> tuple[float, int]:
        """Summed next-token NLL of the tokens after `prefix_len` in ids [B, L] (and their count) when the prefix's
        KV was written with `prefix_layers` INT4 and the rest runs with `suffix_layers` INT4, reading that KV: what
        a prefix-cache hit across a morph swap serves. Equal lists give the exact two-chunk prefill."""
        B, L = ids.shape
        if not 0 < prefix_len < L - 1:
            raise ValueError(f"prefix_len {prefix_len}: need 0 < prefix_len < {L - 1} (the window's length - 1)")
        per = -(-L // BLOCK)
        self._hold(B * per)
        tables = [list(range(b * per, (b + 1) * per)) for b in range(B)]
        h = None
        for layers, lo, hi in ((prefix_layers, 0, prefix_len), (suffix_layers, prefix_len, L)):
            self.set_quantized(layers)
            n = hi - lo
            plan = AttentionPlan(self.pool, [SeqSlice(b * n, n, hi, tables[b]) for b in range(B)])
            pos = torch.arange(lo, hi).repeat(B)
            h = self.model.head.embed(ids[:, lo:hi].flatten()).to(self.model.norm.dtype)
            h = self.run_layers(h, 0, plan, (self.model.cos[pos], self.model.sin[pos]))
        logits = self.logits(h).view(B, L - prefix_len, -1)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, prefix_len + 1 :].reshape(-1), reduction="sum"
        )
        return float(loss), ids[:, prefix_len + 1 :].numel()

    @torch.inference_mode()
    def token_nll(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token negative log-likelihood at every position of ids [B, L], as float64 [B, L-1]: the log-softmax
        of the fp32 logits taken in float64, as a peer's scorer (tools/llama_nll.cpp) takes it."""
        states, _, _ = self.layer_inputs(ids)
        logits = self.logits(states[-1]).view(ids.shape[0], ids.shape[1], -1)
        return torch.stack(
            [
                F.cross_entropy(logits[b, :-1].double(), ids[b, 1:], reduction="none")  # a window at a time
                for b in range(ids.shape[0])
            ]
        )


def corpus_text(path: Path, start_frac: float, end_frac: float, n: int, length: int) -> str:
    """The text corpus_tokens encodes: a slice of a file (fractions of its characters), cut to ~8 chars a token."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[int(len(text) * start_frac) : int(len(text) * end_frac)][: n * length * 8]


def corpus_tokens(tokenizer, path: Path, start_frac: float, end_frac: float, n: int, length: int) -> torch.Tensor:
    """n windows of `length` tokens from a slice of a text file (fractions of its characters)."""
    ids = tokenizer.encode(corpus_text(path, start_frac, end_frac, n, length))
    if len(ids) < n * length:
        raise ValueError(f"{path}: not enough text for {n} x {length} tokens")
    return torch.tensor(ids[: n * length]).view(n, length)
