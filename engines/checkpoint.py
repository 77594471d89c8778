"""What every importer returns: a model config, HF-named fp32 tensors, and a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tokenizers import Tokenizer

from trtllm_backend.manifest import ModelConfig

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: str | None
    # Lazy tensor access so an importer never holds the whole model twice.
    shared: Callable[[], dict[str, torch.Tensor]]
    layer: Callable[[int], dict[str, torch.Tensor]]
    source: dict = field(default_factory=dict)
