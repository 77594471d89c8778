"""Import a Hugging Face Llama checkpoint directory: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from trtllm_backend.manifest import ModelConfig

from .checkpoint import LAYER_TENSORS, Checkpoint


def _first_id(value):
    return value[0] if isinstance(value, list) else value


def load_hf(directory: str | Path) -> Checkpoint:
    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{d}/config.json: model_type {cfg.get('model_type')!r} is not supported (llama only)")
    n_heads = cfg["num_attention_heads"]
    config = ModelConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        eos_token_id=_first_id(cfg["eos_token_id"]),
        pad_token_id=_first_id(cfg.get("pad_token_id")),
    )
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                where[k] = f

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{d}: tensor {name} not found in the checkpoint")
        with safe_open(where[name], "pt") as sf:
            return sf.get_tensor(name).float().contiguous()

    def shared():
        out = {
            "model.embed_tokens.weight": get("model.embed_tokens.weight"),
            "model.norm.weight": get("model.norm.weight"),
        }
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = get("lm_head.weight")
        return out

    def layer(i: int):
        return {n: get(f"model.layers.{i}.{n}") for n in LAYER_TENSORS}

    tok_cfg = d / "tokenizer_config.json"
    template = json.loads(tok_cfg.read_text()).get("chat_template") if tok_cfg.is_file() else None
    return Checkpoint(
        name=d.name,
        config=config,
        tokenizer=Tokenizer.from_file(str(d / "tokenizer.json")),
        chat_template=template,
        shared=shared,
        layer=layer,
        source={"format": "hf-safetensors", "dir": d.name},
    )
