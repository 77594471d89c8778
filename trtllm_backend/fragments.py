"""Loading fragments from the fragment set into runnable layer weights (off the hot path)."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from .layers import LayerWeights, dense_layer
from .manifest import FULL, Manifest


class FragmentStore:
    """Reads verified fragment files; `load_layer` may run on any thread (it touches no engine state)."""

    def __init__(self, manifest: Manifest, dtype: torch.dtype):
        self.manifest = manifest
        self.dtype = dtype

    def load_shared(self) -> dict[str, torch.Tensor]:
        path = self.manifest.verified_path(self.manifest.data["shared"])
        return {k: v.to(self.dtype) for k, v in load_file(path).items()}

    def load_layer(self, index: int, precision: str = FULL) -> LayerWeights:
        entry = self.manifest.fragment(index, precision)
        tensors = load_file(self.manifest.verified_path(entry))
        if precision == FULL:
            return dense_layer(tensors, self.dtype)
        from plugins.quant_matmul import load_quantized_layer  # quantized kernels load only when used

        parts = load_quantized_layer(tensors, entry)
        return LayerWeights(**{k: parts[k] for k in LayerWeights.__slots__})

    def available(self, index: int) -> list[str]:
        return self.manifest.precisions(index)
