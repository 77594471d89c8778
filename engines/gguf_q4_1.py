"""Q4_1 fragments: a GGUF's own 4-bit blocks as layer fragments, kept exactly (engines.build_fragments --q4-1).

A GGUF's Q4_1 tensor stores each row in blocks of 32 weights: fp16 scale d, fp16 min m, then 16 bytes of nibbles
(weight j in the low nibble of byte j, weight j + 16 in its high nibble), w = q * d + m. The full-precision fragments
of a set built from that GGUF hold those weights dequantized to fp32; the Q4_1 fragment holds the blocks
themselves, re-laid into the portable INT4 nibble order with d and m untouched (plugins/quant_matmul.py), so it
dequantizes to the full fragment bit for bit, in a quarter of the bytes less the block overhead. `write_q4_1` checks
exactly that before it lists a fragment.

These are not the AWQ INT4 fragments: those re-quantize the full weights (+6.7% perplexity with every layer INT4)
and stand in for an FP16 model's INT4 form in morphing. Q4_1 serves a GGUF as it is (morph_policy=q4_1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.torch import save_file
from tqdm import tqdm

from plugins.quant_matmul import Q4_1_BLOCK, dequantize_q4_1
from trtllm_backend.errors import FragmentError
from trtllm_backend.fragments import read_safetensors
from trtllm_backend.manifest import Manifest, file_entry, write_manifest
from trtllm_backend.precision import Precision

from .gguf_import import embedded_model_path, interleaved_to_half_split

METHOD = "gguf-q4_1"
_BLOCK_BYTES = 4 + Q4_1_BLOCK // 2  # d, m (fp16 each), 16 bytes of nibbles

# (fused name, the GGUF tensors sharing its input in row order, the RMSNorm before it or None)
GROUPS = (
    ("qkv", ("attn_q", "attn_k", "attn_v"), "attn_norm"),
    ("o", ("attn_output",), None),
    ("gate_up", ("ffn_gate", "ffn_up"), "ffn_norm"),
    ("down", ("ffn_down",), None),
)
_NORMS = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}


def q4_1_rows(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [rows, cols/32 * 20] -> (qweight uint8 [rows, cols/2] in the portable nibble order,
    scales_mins fp16 [rows, cols/32, 2]: each block's d and m, the file's bits)."""
    if cols % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows of {cols} weights are not whole blocks of {Q4_1_BLOCK}")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // Q4_1_BLOCK, _BLOCK_BYTES)
    dm = blocks[..., :4].copy().view(np.float16)  # [rows, blocks, 2]: d, m
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # weight j, then j + 16, per block
    qweight = (q[:, 0::2] << 4) | q[:, 1::2]  # element 2i in the high nibble (plugins/quant_matmul.py)
    return torch.from_numpy(qweight.astype(np.uint8)), torch.from_numpy(dm)


def _permute_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF's interleaved RoPE rows -> the half-split order, for any [rows, ...] tensor (as the full weights are)."""
    flat = t.reshape(t.shape[0], -1)
    return interleaved_to_half_split(flat, n_heads).reshape(t.shape)


class Q41Source:
    """The Q4_1 layer tensors of a GGUF file, fused and permuted as the full-precision fragments are."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else embedded_model_path()
        reader = GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in reader.tensors}
        field = reader.fields.get("llama.attention.head_count")
        kv = reader.fields.get("llama.attention.head_count_kv")
        self.heads = {"attn_q": int(field.contents()), "attn_k": int((kv or field).contents())}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's Q4_1 fragment tensors: qkv / o / gate_up / down (.qweight, .scales_mins) and the two norms."""
        out: dict[str, torch.Tensor] = {}
        for name, parts, norm in GROUPS:
            qs, dms = [], []
            for part in parts:
                t = self.tensors[f"blk.{i}.{part}.weight"]
                if t.tensor_type != GGMLQuantizationType.Q4_1:
                    raise FragmentError(
                        f"{self.path.name}: blk.{i}.{part}.weight is {t.tensor_type.name}, not Q4_1: "
                        "no lossless Q4_1 fragment (only a GGUF whose linear weights are all Q4_1)"
                    )
                cols, rows = (int(x) for x in t.shape)  # GGUF lists the innermost dimension first
                q, dm = q4_1_rows(t.data, rows, cols)
                if part in self.heads:
                    q, dm = _permute_rows(q, self.heads[part]), _permute_rows(dm, self.heads[part])
                qs.append(q)
                dms.append(dm)
            out[name + ".qweight"] = torch.cat(qs).contiguous()
            out[name + ".scales_mins"] = torch.cat(dms).contiguous()
            if norm is not None:
                t = self.tensors[f"blk.{i}.{norm}.weight"]
                out[_NORMS[norm]] = torch.from_numpy(np.array(t.data, dtype=np.float32, copy=True).reshape(-1))
        return out


# The full fragment's tensors each fused Q4_1 weight must reproduce, in row order.
_FULL = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def mismatches(q41: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> list[str]:
    """Where a Q4_1 fragment does not dequantize to the full fragment bit for bit (empty: lossless)."""
    bad = []
    for name, parts in _FULL.items():
        want = torch.cat([full[p + ".weight"] for p in parts])
        got = dequantize_q4_1(q41, name + ".")
        if got.shape != want.shape or not torch.equal(got, want):
            bad.append(name)
    for norm in _NORMS.values():
        if not torch.equal(q41[norm], full[norm]):
            bad.append(norm)
    return bad


def q4_1_current(manifest: Manifest) -> bool:
    """Every layer lists a Q4_1 fragment of this method that verifies."""
    try:
        for i in range(manifest.num_layers):
            entry = manifest.fragment(i, Precision.Q4_1)
            if entry.get("method") != METHOD:
                return False
            manifest.verified_path(entry)
        return True
    except (FragmentError, KeyError, IndexError):
        return False


def write_q4_1(fragment_dir: Path, gguf: str | Path | None = None) -> dict:
    """Write `layer_XXX.q4_1.safetensors` for every layer of the set in `fragment_dir` from the GGUF it was built
    from, each checked bitwise against the layer's full fragment, and list them in the manifest."""
    from .build_fragments import layer_file

    m = Manifest(fragment_dir)
    src = Q41Source(gguf)
    source = m.data.get("source") or {}
    if source.get("format") != "gguf" or source.get("file") != src.path.name:
        raise FragmentError(
            f"{fragment_dir}: the set was built from {source or 'an unknown source'}, not {src.path.name}: "
            "Q4_1 fragments come from the GGUF whose dequantized weights the full fragments are"
        )
    entries = []
    for i in tqdm(range(m.num_layers), desc="Q4_1 fragments", unit="layer"):
        tensors = src.layer(i)
        full = read_safetensors(m.verified_path(m.fragment(i, Precision.FULL)))
        if bad := mismatches(tensors, full):
            raise FragmentError(
                f"layer {i}: the Q4_1 blocks of {src.path.name} do not dequantize to the full fragment "
                f"bit for bit ({', '.join(bad)}); rebuild the set from this GGUF"
            )
        path = fragment_dir / layer_file(i, Precision.Q4_1)
        path.unlink(missing_ok=True)  # never write through a symlink into another set
        save_file(
            tensors,
            path,
            metadata={
                "format": "pt",
                "layer": str(i),
                "precision": Precision.Q4_1,
                "group_size": str(Q4_1_BLOCK),
                "method": METHOD,
            },
        )
        entries.append(file_entry(path, group_size=Q4_1_BLOCK, method=METHOD, format="safetensors"))
    data = Manifest(fragment_dir).data  # re-read: other builders write the manifest too
    for i, entry in enumerate(entries):
        data["layers"][i]["fragments"][Precision.Q4_1] = entry
    write_manifest(fragment_dir, data)
    return data


def ensure_q4_1(fragment_dir: Path, gguf: str | Path | None = None, force: bool = False) -> str:
    """The set's Q4_1 fragments written unless they are there and verify (always with `force`): "built" or
    "up to date"."""
    if not force and q4_1_current(Manifest(fragment_dir)):
        return "up to date"
    write_q4_1(fragment_dir, gguf)
    return "built"
