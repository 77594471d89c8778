"""One decoder layer's four matmuls at a few row counts, three ways: the engine's path for full-precision weights
stored in fp16 under fp32 activations (plugins/skinny_gemm: the C++ kernel up to MAX_ROWS rows, else MKL on a
widened copy), its path for weights stored in bf16 (weight_dtype=bfloat16: the C++ AVX512_BF16 kernel up to
MAX_ROWS rows, else torch's bf16 linear), and torch's bfloat16 linear alone (oneDNN; AMX where the CPU has it),
the dtype vLLM's CPU backend serves in. Random weights of SmolLM2-135M's shapes; the median of `reps` calls.

    python -m tools.bench_linear_dtypes [--rows 1 4 16 32 64 128] [--threads 1] [--json FILE]

It answers where each path wins, not what a served step costs (no attention, no norms, no scheduling).
"""

from __future__ import annotations

import argparse
import json

import torch

from plugins import cpu_kernels, skinny_gemm
from tools.bench_engine import median_time

# SmolLM2-135M: fused qkv (576 -> 576 + 2 x 192), o (576 -> 576), fused gate_up (576 -> 2 x 1536), down (1536 -> 576)
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _median_ms(fn, reps: int) -> float:
    return median_time(fn, reps, warmup=1) * 1e3


def layer_ms(rows: int, reps: int = 30, seed: int = 0) -> dict[str, float]:
    """ms for one layer's matmuls at `rows` rows: {"fp16_weights_fp32": ..., "bf16": ...}."""
    gen = torch.Generator().manual_seed(seed)
    out = {"fp16_weights_fp32": 0.0, "bf16_weights_engine": 0.0, "bf16": 0.0}
    for n, k in LAYER_SHAPES:
        x = torch.randn(rows, k, generator=gen)
        w16 = (torch.randn(n, k, generator=gen) * 0.05).half()
        wbf = w16.bfloat16()
        out["fp16_weights_fp32"] += _median_ms(lambda: skinny_gemm.linear(x, w16), reps)
        out["bf16_weights_engine"] += _median_ms(lambda: skinny_gemm.linear(x, wbf), reps)
        out["bf16"] += _median_ms(lambda: torch.nn.functional.linear(x.bfloat16(), wbf).float(), reps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.ops() is not None
    bf16_kernel = skinny_gemm.bf16_kernel_available()
    print(
        f"[linear] threads {args.threads}; C++ kernels: {'yes' if kernels else 'no (MKL on widened weights)'}; "
        f"bf16 kernel: {'yes' if bf16_kernel else 'no (torch)'}"
    )
    print(
        f"{'rows':>5} {'fp16 weights, fp32 ms':>22} {'bf16 weights ms':>16} {'torch bf16 ms':>14} "
        f"{'fp16 / bf16 weights':>20}"
    )
    result = {"threads": args.threads, "cpp_kernels": kernels, "bf16_kernel": bf16_kernel, "shapes": LAYER_SHAPES}
    result["rows"] = []
    for rows in args.rows:
        ms = layer_ms(rows, args.reps)
        ratio = ms["fp16_weights_fp32"] / ms["bf16_weights_engine"]
        print(
            f"{rows:>5} {ms['fp16_weights_fp32']:>22.3f} {ms['bf16_weights_engine']:>16.3f} {ms['bf16']:>14.3f} "
            f"{ratio:>20.2f}"
        )
        result["rows"].append(
            {
                "rows": rows,
                **ms,
                "fp32_over_bf16": ms["fp16_weights_fp32"] / ms["bf16"],
                "fp16_over_bf16_weights": ratio,
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
