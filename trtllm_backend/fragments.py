"""Loading fragments from the fragment set into runnable layer weights (off the hot path)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from . import huge_pages
from .errors import FragmentError
from .head import DenseTable
from .layers import LayerWeights, dense_layer
from .manifest import Manifest
from .precision import Precision


_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def read_safetensors(path: Path, alloc: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file straight into owned tensors, each in a uint8 buffer from `alloc(nbytes)` (default:
    torch.empty; huge_pages.empty puts the large ones on 2 MiB pages).

    NOTE: not safetensors' load_file: it mmaps, so weights count in RSS only once touched and stay mapped
    while any view lives, and load(bytes) holds the file twice. Reading into each tensor's own storage
    keeps the memory account exact and the load transient-free.
    """
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            buf = alloc(end - start) if alloc else torch.empty(end - start, dtype=torch.uint8)
            f.seek(base + start)
            if f.readinto(memoryview(buf.numpy())) != end - start:
                raise ValueError(f"{path}: truncated tensor {name}")
            out[name] = buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


HEAD_TENSOR = "model.embed_tokens"  # the INT8 table's tensors: <HEAD_TENSOR>.weight (int8), .scales (fp32)


class FragmentStore:
    """Reads verified fragment files; `load_layer` may run on any thread (it touches no engine state).

    With `huge_pages` (EngineConfig.huge_pages) the weights it hands out sit on 2 MiB pages: each layer in one
    buffer, the embedding / LM head table in its own (trtllm_backend.huge_pages says why)."""

    def __init__(
        self, manifest: Manifest, dtype: torch.dtype, weight_dtype: torch.dtype | None = None, huge_pages: bool = True
    ):
        self.manifest = manifest
        self.dtype = dtype  # activations and norms
        self.weight_dtype = weight_dtype or dtype  # full-precision matmul weights, embedding and LM head
        self.huge_pages = huge_pages

    def _read(self, entry: dict) -> dict[str, torch.Tensor]:
        return read_safetensors(self.manifest.verified_path(entry))

    def load_shared(self) -> dict[str, torch.Tensor]:
        """The embedding / LM head table and the final norm. On huge pages the table is read there, or converted
        there (no copy of a table that already has its dtype: an fp32 table is 113 MB)."""
        path = self.manifest.verified_path(self.manifest.data["shared"])
        out = {}
        for k, v in read_safetensors(path, huge_pages.empty if self.huge_pages else None).items():
            dtype = self.dtype if v.dim() == 1 else self.weight_dtype
            convert_there = self.huge_pages and v.dtype != dtype
            out[k] = huge_pages.empty_tensor(v.shape, dtype).copy_(v) if convert_there else v.to(dtype)
        return out

    def load_head(self, precision: str = Precision.FULL):
        """The tied embedding / LM head table in `precision` (full: from the shared file, in weight_dtype)."""
        if precision == Precision.FULL:
            return DenseTable(self.load_shared()["model.embed_tokens.weight"])
        from plugins.int8_linear import Int8Table  # quantized kernels load only when used

        if precision != Precision.INT8:
            raise FragmentError(f"lm_head: no runtime for a '{precision}' table (int8 only)")
        table = Int8Table.from_tensors(self._read(self.manifest.head_fragment(precision)), HEAD_TENSOR + ".")
        if self.huge_pages:  # the kernel's packing is a fresh tensor: moved once the file's bytes are freed
            table.adopt(huge_pages.pack(table.resident_tensors()))
        return table

    def load_layer(self, index: int, precision: str = Precision.FULL) -> LayerWeights:
        entry = self.manifest.fragment(index, precision)
        tensors = self._read(entry)
        if precision == Precision.FULL:
            layer = dense_layer(tensors, self.dtype, self.weight_dtype)
        else:
            from plugins.quant_matmul import load_quantized_layer  # quantized kernels load only when used

            parts = load_quantized_layer(tensors, entry)
            layer = LayerWeights(**{k: parts[k] for k in LayerWeights.__slots__})
        del tensors  # the file's bytes go before the layer is copied into one buffer
        return layer.pack_on_huge_pages() if self.huge_pages else layer
