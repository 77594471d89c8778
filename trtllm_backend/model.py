"""The Llama model: shared weights (embedding, final norm, LM head) around a list of layer slots."""

from __future__ import annotations

import torch

from plugins.decode_layer import RunCache
from plugins.elementwise import rms_norm

from .attention import AttentionPlan
from .fragments import FragmentStore
from .head import DenseTable, HeadSlot
from .layers import LayerSlot, run_layers
from .manifest import ModelConfig


class LlamaModel:
    def __init__(self, store: FragmentStore, max_positions: int):
        self.config: ModelConfig = store.manifest.config
        shared = store.load_shared()
        self.norm = shared["model.norm.weight"]
        # The embedding and the LM head: one table when tied (a swappable unit, trtllm_backend/head.py).
        untied = shared.get("lm_head.weight")
        self.head = HeadSlot(
            DenseTable(shared["model.embed_tokens.weight"]), None if untied is None else DenseTable(untied)
        )
        self._runs = RunCache()
        self.slots = [
            LayerSlot(i, self.config, store.load_layer(i), runs=self._runs) for i in range(self.config.num_layers)
        ]
        self.cos, self.sin = self._rope_tables(max_positions)

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        return angles.cos().to(self.norm.dtype), angles.sin().to(self.norm.dtype)

    @property
    def embed(self):
        """The embedding table's weight (a tensor at full precision, the Int8Table when morphed)."""
        t = self.head.table
        return t.weight if isinstance(t, DenseTable) else t

    @property
    def lm_head(self):
        """The LM head's weight (the embedding's when tied)."""
        return self.head.untied.weight if self.head.untied is not None else self.embed

    @property
    def shared_nbytes(self) -> int:
        return self.norm.numel() * self.norm.element_size() + self.head.nbytes

    @property
    def weights_nbytes(self) -> int:
        return self.shared_nbytes + sum(s.weights.nbytes for s in self.slots)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, logit_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Flattened tokens of all scheduled sequences -> fp32 logits of the rows that sample (`logit_rows`; None:
        every row, as in a pure decode step)."""
        h = self.head.embed(input_ids).to(self.norm.dtype)  # fp16-stored or INT8 table -> compute dtype
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        h = run_layers(self.slots, h, cos, sin, plan, self._runs)
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        return self.head.logits(h).float()
