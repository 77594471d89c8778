"""The Llama model: shared weights (embedding, final norm, LM head) around a list of layer slots."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins import skinny_gemm
from plugins.elementwise import rms_norm

from .attention import AttentionPlan
from .fragments import FragmentStore
from .layers import LayerSlot, run_layers
from .manifest import ModelConfig


class LlamaModel:
    def __init__(self, store: FragmentStore, max_positions: int):
        self.config: ModelConfig = store.manifest.config
        shared = store.load_shared()
        self.embed = shared["model.embed_tokens.weight"]
        self.norm = shared["model.norm.weight"]
        self.lm_head = shared.get("lm_head.weight", self.embed)  # tied embeddings share the tensor
        self.slots = [LayerSlot(i, self.config, store.load_layer(i)) for i in range(self.config.num_layers)]
        self.cos, self.sin = self._rope_tables(max_positions)

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        return angles.cos().to(self.norm.dtype), angles.sin().to(self.norm.dtype)

    @property
    def shared_nbytes(self) -> int:
        tensors = {id(t): t for t in (self.embed, self.norm, self.lm_head)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def weights_nbytes(self) -> int:
        return self.shared_nbytes + sum(s.weights.nbytes for s in self.slots)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, logit_rows: torch.Tensor) -> torch.Tensor:
        """Flattened tokens of all scheduled sequences -> fp32 logits of the rows that sample."""
        h = F.embedding(input_ids, self.embed).to(self.norm.dtype)  # fp16-stored embedding -> compute dtype
        cos, sin = self.cos[positions], self.sin[positions]
        h = run_layers(self.slots, h, cos, sin, plan)
        h = rms_norm(h.index_select(0, logit_rows), self.norm, self.config.rms_norm_eps)
        return skinny_gemm.linear(h, self.lm_head).float()
