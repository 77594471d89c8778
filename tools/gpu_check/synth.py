"""A random-weight fragment set of a shape, generated on the device, in the project's formats.

The full-precision set is written by engines.build_fragments.build from a Checkpoint whose tensors are drawn on the
device; each layer's INT4 fragment is the same weights (drawn again from the same seed) quantized round-to-nearest
per group (engines.quantize_awq.int4_fragment with unit AWQ scales: no calibration), on the device too. The
tokenizer is a word-level one: token i is the word `w<i>`, so a prompt of n words is n tokens.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from engines.build_fragments import build, layer_file
from engines.checkpoint import LAYER_TENSORS, Checkpoint
from engines.quantize_awq import GROUPS, int4_fragment
from trtllm_backend.manifest import Manifest, file_entry, write_manifest
from trtllm_backend.precision import Precision

from .shapes import EOS_ID, Shape

LOGIT_STD = 3.0  # of the random LM head's logits: top-2 gaps well above fp16 rounding (the exactness check's tokens)


def tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {"<unk>": 0, "<eos>": EOS_ID, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def prompt(ids: list[int]) -> str:
    """The text that the synthetic tokenizer encodes to `ids` (each >= 2)."""
    return " ".join(f"w{i}" for i in ids)


def _shape_of(shape: Shape, name: str) -> tuple[int, ...]:
    c = shape.config
    q, kv, hid, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {
        "self_attn.q_proj.weight": (q, hid),
        "self_attn.k_proj.weight": (kv, hid),
        "self_attn.v_proj.weight": (kv, hid),
        "self_attn.o_proj.weight": (hid, q),
        "mlp.gate_proj.weight": (inter, hid),
        "mlp.up_proj.weight": (inter, hid),
        "mlp.down_proj.weight": (hid, inter),
    }.get(name, (hid,))


def layer_tensors(shape: Shape, index: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s fp32 tensors on `device` (HF names): each output of unit variance for unit-RMS inputs."""
    g = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
    out = {}
    for name in LAYER_TENSORS:
        dims = _shape_of(shape, name)
        t = torch.randn(dims, generator=g, device=device)
        out[name] = 1.0 + 0.1 * t if len(dims) == 1 else t / math.sqrt(dims[1])
    return out


def shared_tensors(shape: Shape, device: str, seed: int) -> dict[str, torch.Tensor]:
    c = shape.config
    g = torch.Generator(device=device).manual_seed(seed * 100_003 - 1)
    table = lambda: (
        torch.randn(c.vocab_size, c.hidden_size, generator=g, device=device) * (LOGIT_STD / math.sqrt(c.hidden_size))
    )
    out = {"model.embed_tokens.weight": table(), "model.norm.weight": torch.ones(c.hidden_size, device=device)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = table()
    return out


def _to_file(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).cpu().contiguous() for k, v in tensors.items()}


def write_int4(out: Path, shape: Shape, device: str, seed: int) -> list[dict]:
    unit = {
        name: torch.ones(shape.config.intermediate_size if name == "down" else shape.config.hidden_size, device=device)
        for name, _, _ in GROUPS
    }
    entries = []
    for i in range(shape.config.num_layers):
        tensors = int4_fragment(layer_tensors(shape, i, device, seed), unit, shape.group_size)
        path = out / layer_file(i, Precision.INT4)
        save_file(
            {k: v.cpu().contiguous() for k, v in tensors.items()},
            path,
            metadata={"format": "pt", "layer": str(i), "precision": Precision.INT4},
        )
        entries.append(file_entry(path, group_size=shape.group_size, method="rtn", format="safetensors"))
    return entries


def build_set(out: Path, shape: Shape, device: str, seed: int = 0) -> dict:
    """Write the set into `out` (full and INT4 fragments of every layer); returns what it took."""
    t0 = time.perf_counter()
    dtype = shape.file_dtype
    ckpt = Checkpoint(
        name=f"random-{shape.name}",
        config=shape.config,
        tokenizer=tokenizer(shape.config.vocab_size),
        chat_template=None,
        shared=lambda: _to_file(shared_tensors(shape, device, seed), dtype),
        layer=lambda i: _to_file(layer_tensors(shape, i, device, seed), dtype),
        source={"format": "random", "seed": seed, "generated_on": device},
    )
    build(ckpt, out, ckpt.name)
    t1 = time.perf_counter()
    int4 = write_int4(out, shape, device, seed)
    data = Manifest(out).data
    kind = str(dtype).removeprefix("torch.")
    data["shared"]["dtype"] = kind
    for layer, entry in zip(data["layers"], int4):
        layer["fragments"][Precision.FULL]["dtype"] = kind
        layer["fragments"][Precision.INT4] = entry
    write_manifest(out, data)
    files = [p for p in out.iterdir() if p.is_file()]
    return {
        "dir": str(out),
        "full_s": round(t1 - t0, 2),
        "int4_s": round(time.perf_counter() - t1, 2),
        "bytes_written": sum(p.stat().st_size for p in files),
        "files": len(files),
    }
