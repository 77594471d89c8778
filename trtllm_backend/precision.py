"""The precisions a decoder layer's fragment can have: one vocabulary for manifests, the runtime and tools.

A `StrEnum`, so a member is its string everywhere it is written down (manifest keys, logs, JSON, metrics):
`Precision.INT4 == "int4"` and `f"{Precision.INT4}"` is `int4`.
"""

from __future__ import annotations

from enum import StrEnum


class Precision(StrEnum):
    FULL = "full"  # the checkpoint's weights (fp32 on disk; the compute or fp16 storage dtype when loaded)
    INT4 = "int4"  # AWQ, group-wise, what the morph manager swaps to
    INT8 = "int8"  # per-channel RTN, a middle rung built beside INT4
    # A GGUF's own Q4_1 blocks kept exactly (fp16 scale and min per 32 weights), run by the INT4 kernels: lossless
    # against FULL where FULL is that GGUF dequantized. Served by the static policy `q4_1`; not a morph rung (the
    # AWQ INT4 fragments stand in for an FP16 model's INT4 form there).
    Q4_1 = "q4_1"


# EngineConfig.lm_head_precision's values (a tied embedding / LM head: its table bound full, INT8 at load, or morphed).
HEAD_FULL, HEAD_INT8, HEAD_DYNAMIC = "full", "int8", "dynamic"
LM_HEAD_PRECISIONS = (HEAD_FULL, HEAD_INT8, HEAD_DYNAMIC)


def parse_precision(name: str) -> Precision:
    try:
        return Precision(name)
    except ValueError:
        raise ValueError(f"unknown precision {name!r} (known: {', '.join(p.value for p in Precision)})") from None
