"""Perplexity versus the number of INT4 layers, for several swap orders (the paper's Table 3/8 for this model).

    python -m tools.eval_quality [--fragment-dir DIR] [--corpus FILE] [--windows 8 --seq-len 256] [--out results/quality]
    python -m tools.eval_quality --lm-head --fragment-dir DIR   # the INT8 embedding / LM head's cost (lm_head.json)
    python -m tools.eval_quality --int4-activations   # int8 vs fp32 activations in the INT4 decode kernel
    python -m tools.eval_quality --kv-cache-check     # the KV cache stored in fp16 vs fp32 (kv_cache.json)
    python -m tools.eval_quality --kv-reuse-check --seq-len 512   # a prefix's KV read at another precision
    python -m tools.eval_quality --q4-1 --fragment-dir DIR   # the GGUF's Q4_1 blocks served as they are (q4_1.json)

Held-out text: the last 10% of the corpus (calibration and profiling use the first 80%). Orders:
front-to-back, back-to-front, random (seeded) and LIS (the profiled swap order in the manifest). Writes
quality.json (every number, plus the LIS curve for every k so serving reports can weight quality per token),
quality.md (the table) and quality.png (the plot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from engines.build_fragments import default_fragment_dir
from engines.offline_model import OfflineModel, corpus_tokens
from tools.replay.provenance import code_version
from trtllm_backend.kernel_numerics import KernelNumerics
from trtllm_backend.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "corpus" / "austen_novels.txt"
COUNTS = (0, 1, 2, 4, 8, 16, 30)
HELD_OUT = (0.9, 1.0)  # fractions of the corpus: calibration and profiling use the first 80%


def held_out_ids(manifest, args):
    """The held-out windows [args.windows, args.seq_len] every check scores (args: corpus, windows, seq_len)."""
    return corpus_tokens(Tokenizer(manifest), Path(args.corpus), *HELD_OUT, args.windows, args.seq_len)


def held_out_meta(args) -> dict:
    """How a result names those windows (its "held_out"; tokens are added once scored)."""
    return {"corpus": Path(args.corpus).name, "range": list(HELD_OUT), "windows": args.windows, "seq_len": args.seq_len}


def orders(model: OfflineModel, seed: int) -> dict[str, list[int]]:
    n = model.config.num_layers
    shuffled = list(range(n))
    random.Random(seed).shuffle(shuffled)
    out = {
        "front-to-back": list(range(n)),
        "back-to-front": list(range(n - 1, -1, -1)),
        f"random(seed={seed})": shuffled,
    }
    if model.manifest.data.get("swap_order_profile"):
        out["LIS"] = model.manifest.swap_order()
    return out


def perplexity(model: OfflineModel, ids, layers: list[int], batch: int = 4, head_int8: bool | None = None) -> float:
    """head_int8: bind the embedding / LM head to its INT8 fragment (True) or its full table (False); None leaves it."""
    model.set_quantized(layers)
    if head_int8 is not None:
        model.set_head(head_int8)
    nll, n = 0.0, 0
    for i in range(0, ids.shape[0], batch):
        a, b = model.nll(ids[i : i + batch])
        nll, n = nll + a, n + b
    return math.exp(nll / n)


def plot(results: dict, full_ppl: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, row in results.items():
        ks = sorted(int(k) for k in row)
        ax.plot(ks, [row[str(k)] for k in ks], marker="o", label=name)
    ax.axhline(full_ppl, color="gray", ls=":", label="full precision")
    ax.set_xlabel("INT4 layers")
    ax.set_ylabel("perplexity (held-out Austen)")
    ax.set_title("SmolLM2-135M: quality vs quantized layers, by swap order")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def storage_check(args, t0: float) -> int:
    """Full-precision perplexity with the weights stored in fp32, in fp16 (widened to fp32 for compute, as the
    served weight_dtype=float16 does) and in bf16 (matmuls on bf16 inputs with fp32 sums, weight_dtype=bfloat16),
    on the same held-out tokens."""
    import torch

    out: dict = {
        "command": f"python -m tools.eval_quality --storage-check --windows {args.windows} --seq-len {args.seq_len}",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "held_out": held_out_meta(args),
    }
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        model = OfflineModel(args.fragment_dir, max_len=args.seq_len, weight_dtype=dtype)
        ids = held_out_ids(model.manifest, args)
        out[name] = perplexity(model, ids, [])
        print(f"[quality] full precision, weights stored in {name}: perplexity {out[name]:.4f}", flush=True)
    for name in ("float16", "bfloat16"):
        out[f"{name}_vs_float32_pct"] = 100 * (out[name] / out["float32"] - 1)
    out["bfloat16_vs_float16_pct"] = 100 * (out["bfloat16"] / out["float16"] - 1)
    path = _write_check(args, out, ids, t0, "storage.json")
    print(
        f"[quality] against fp32 storage, fp16 moves perplexity by {out['float16_vs_float32_pct']:+.4f}%, bf16 by "
        f"{out['bfloat16_vs_float32_pct']:+.4f}%; wrote {path}"
    )
    return 0


def kv_cache_check(args, t0: float) -> int:
    """Perplexity with the paged KV cache stored in fp32 and in fp16 (kv_cache_dtype), weights stored in fp16 as
    served, with no INT4 layer and with every layer INT4 (LIS order), on the same held-out tokens."""
    import torch

    out: dict = {
        "command": "python -m tools.eval_quality --kv-cache-check",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "weight_dtype": "float16",
        "held_out": held_out_meta(args),
        "runs": [],
    }
    models = {
        name: OfflineModel(args.fragment_dir, max_len=args.seq_len, weight_dtype=torch.float16, kv_dtype=dtype)
        for name, dtype in (("float32", torch.float32), ("float16", torch.float16))
    }
    ids = held_out_ids(models["float32"].manifest, args)
    n = models["float32"].config.num_layers
    for layers in ([], models["float32"].manifest.swap_order()[:n]):
        row = {"int4_layers": len(layers)} | {f"kv_{name}": perplexity(m, ids, layers) for name, m in models.items()}
        row["float16_vs_float32_pct"] = 100 * (row["kv_float16"] / row["kv_float32"] - 1)
        out["runs"].append(row)
        print(
            f"[quality] {len(layers)} INT4 layers: KV fp32 {row['kv_float32']:.4f}, fp16 {row['kv_float16']:.4f} "
            f"({row['float16_vs_float32_pct']:+.4f}%)",
            flush=True,
        )
    path = _write_check(args, out, ids, t0, "kv_cache.json")
    print(f"[quality] {out['seconds']} s; wrote {path}")
    return 0


REUSE_COUNTS = (0, 4, 8, 16, 30)  # INT4 layers (LIS order): full, the dynamic policies' usual range, all-INT4


def kv_reuse_check(args, t0: float) -> int:
    """What a prefix-cache hit across a morph swap costs (kv_cache_reuse_across_morphs): the perplexity of the
    tokens after a prefix whose KV was written with one set of INT4 layers and is read by another, against the
    same tokens with the prefix's KV written by the layers that read it (exact reuse). The prefix is the first
    3/4 of each window, cut to whole 16-token blocks (the cache shares full blocks only); weights and KV stored
    in fp16 as served."""
    import torch

    out: dict = {
        "command": f"python -m tools.eval_quality --kv-reuse-check --windows {args.windows} --seq-len {args.seq_len}",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "weight_dtype": "float16",
        "kv_dtype": "float16",
        "held_out": held_out_meta(args),
        "runs": [],
    }
    model = OfflineModel(args.fragment_dir, max_len=args.seq_len, weight_dtype=torch.float16, kv_dtype=torch.float16)
    ids = held_out_ids(model.manifest, args)
    prefix = (args.seq_len * 3 // 4) // 16 * 16
    out["prefix_tokens"] = prefix
    order = model.manifest.swap_order()
    counts = sorted({min(k, model.config.num_layers) for k in REUSE_COUNTS})
    for reader in counts:
        ppl = {}
        for writer in counts:
            nll, n = 0.0, 0
            for i in range(0, ids.shape[0], 4):
                a, b = model.suffix_nll(ids[i : i + 4], prefix, order[:writer], order[:reader])
                nll, n = nll + a, n + b
            ppl[writer] = math.exp(nll / n)
        for writer in counts:
            row = {
                "kv_written_int4_layers": writer,
                "kv_read_int4_layers": reader,
                "suffix_ppl": ppl[writer],
                "vs_exact_pct": 100 * (ppl[writer] / ppl[reader] - 1),
            }
            out["runs"].append(row)
        print(
            f"[quality] read with {reader:2d} INT4 layers: exact {ppl[reader]:.4f}; KV written with "
            + ", ".join(f"{w}: {100 * (ppl[w] / ppl[reader] - 1):+.3f}%" for w in counts if w != reader),
            flush=True,
        )
    out["suffix_tokens"] = int(ids[:, prefix + 1 :].numel())
    numerics = KernelNumerics.in_force()
    out["kernel_numerics"] = numerics and {f: getattr(numerics, f) for f in numerics.__dataclass_fields__}
    path = _write_check(args, out, ids, t0, "kv_reuse.json")
    print(f"[quality] {out['seconds']} s; wrote {path}")
    return 0


def _write_check(args, out: dict, ids, t0: float, name: str) -> Path:
    """A check's result with its held-out token count and wall time, as `name` in --out."""
    out["held_out"]["tokens"] = int(ids[:, 1:].numel())
    out["seconds"] = round(time.monotonic() - t0, 1)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / name).write_text(json.dumps(out, indent=1))
    return dest / name


def head_check(args, t0: float) -> int:
    """The INT8 embedding / LM head's quality cost: perplexity with the table at full precision (stored in fp32
    and in fp16) and in INT8, with no INT4 layer and with every layer INT4 (the serving order's end), on the same
    held-out tokens; the INT8 head with fp32 and with int8 activations (W8A8, plugins/int8_linear). Needs a
    fragment set with the head's INT8 fragment (engines.build_fragments --lm-head-int8)."""
    import torch

    from plugins.int8_linear import set_head_activations

    frag = Path(args.fragment_dir).resolve()
    shown = frag.relative_to(REPO) if frag.is_relative_to(REPO) else frag  # results name no path of this machine
    out: dict = {
        "command": f"python -m tools.eval_quality --lm-head --fragment-dir {shown}",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "held_out": held_out_meta(args),
        "runs": [],
    }
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16)):
        model = OfflineModel(args.fragment_dir, max_len=args.seq_len, weight_dtype=dtype)
        if model.head_int8 is None:
            raise SystemExit(
                f"{args.fragment_dir}: no INT8 lm_head fragment (python -m engines.build_fragments --lm-head-int8)"
            )
        ids = held_out_ids(model.manifest, args)
        n = model.config.num_layers
        for layers in ([], model.manifest.swap_order()[:n]) if name == "float32" else ([],):
            row = {"weight_dtype": name, "int4_layers": len(layers)}
            for head, int8, acts in (
                ("full", False, "float32"),
                ("int8", True, "float32"),
                ("int8_w8a8", True, "int8"),
            ):
                previous = set_head_activations(acts)  # the INT8 head's activations (lm_head_activations)
                try:
                    row[head] = perplexity(model, ids, layers, head_int8=int8)
                finally:
                    set_head_activations(previous)
            row["int8_vs_full_pct"] = 100 * (row["int8"] / row["full"] - 1)
            row["int8_w8a8_vs_full_pct"] = 100 * (row["int8_w8a8"] / row["full"] - 1)
            out["runs"].append(row)
            print(
                f"[quality] weights {name}, {len(layers)} INT4 layers: lm_head full {row['full']:.4f}, INT8 "
                f"{row['int8']:.4f} ({row['int8_vs_full_pct']:+.3f}%), INT8 with int8 activations "
                f"{row['int8_w8a8']:.4f} ({row['int8_w8a8_vs_full_pct']:+.3f}%)",
                flush=True,
            )
        head = out.setdefault(
            "lm_head", {k: model.manifest.data["lm_head"].get(k) for k in ("swap_rank", "rank_profile")}
        )
        head.setdefault("bytes", {"int8": model.head_int8.nbytes})["full_" + name] = model.head_full.nbytes
    path = _write_check(args, out, ids, t0, "lm_head.json")
    print(f"[quality] {out['seconds']} s; wrote {path}")
    return 0


def activations_check(args, t0: float) -> int:
    """The INT4 decode kernel's activations (plugins.quant_matmul.INT4_ACTIVATIONS): perplexity with every
    token's INT4 linears run through the decode kernel (in chunks of its row limit, as decode steps would),
    with float32 and with int8 activations, at several INT4 layer counts in the serving (LIS) order; and the
    prefill path's (dequantize + MKL) with fp32 and with bf16 matmuls. Full-precision layers are unaffected."""
    from plugins.quant_matmul import decode_kernel_everywhere, set_int4_activations, set_int4_prefill

    out: dict = {
        "command": "python -m tools.eval_quality --int4-activations",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "held_out": held_out_meta(args),
        "runs": [],
    }
    model = OfflineModel(args.fragment_dir, max_len=args.seq_len)
    ids = held_out_ids(model.manifest, args)
    order, n = model.manifest.swap_order(), model.config.num_layers
    previous = set_int4_activations("float32"), set_int4_prefill("float32")
    try:
        for k in sorted({min(c, n) for c in (0, 8, 16, n)}):
            row = {"int4_layers": k, "prefill_path": perplexity(model, ids, order[:k])}
            set_int4_prefill("bfloat16")
            row["prefill_path_bf16"] = perplexity(model, ids, order[:k])
            set_int4_prefill("float32")
            row["prefill_bf16_vs_float32_pct"] = 100 * (row["prefill_path_bf16"] / row["prefill_path"] - 1)
            for name in ("float32", "int8"):
                set_int4_activations(name)
                with decode_kernel_everywhere():
                    row[f"decode_kernel_{name}"] = perplexity(model, ids, order[:k])
            row["int8_vs_float32_pct"] = 100 * (row["decode_kernel_int8"] / row["decode_kernel_float32"] - 1)
            out["runs"].append(row)
            print(
                f"[quality] {k} INT4 layers: prefill path {row['prefill_path']:.4f} (bf16 {row['prefill_path_bf16']:.4f}, "
                f"{row['prefill_bf16_vs_float32_pct']:+.3f}%), decode kernel fp32 "
                f"{row['decode_kernel_float32']:.4f}, int8 {row['decode_kernel_int8']:.4f} "
                f"({row['int8_vs_float32_pct']:+.3f}%)",
                flush=True,
            )
    finally:
        set_int4_activations(previous[0])
        set_int4_prefill(previous[1])
    path = _write_check(args, out, ids, t0, "int4_activations.json")
    print(f"[quality] {out['seconds']} s; wrote {path}")
    return 0


def q4_1_check(args, t0: float) -> int:
    """Every layer on its Q4_1 fragment (the GGUF's own blocks, engines/gguf_q4_1.py) against full precision (the
    same blocks dequantized to fp32), on the same held-out tokens: through the prefill path (dequantize + MKL in
    fp32: the same weights bit for bit, so the same perplexity) and through the INT4 decode kernel for every token
    with fp32 and with int8 activations; beside them the AWQ INT4 fragments (the morph rung) through the same
    kernel, and full precision stored in fp16 (the served weight_dtype=float16). Needs a set with Q4_1 fragments
    (engines.build_fragments --q4-1)."""
    import torch

    from plugins.quant_matmul import decode_kernel_everywhere, set_int4_activations, set_int4_prefill
    from trtllm_backend.precision import Precision

    frag = Path(args.fragment_dir).resolve()
    shown = frag.relative_to(REPO) if frag.is_relative_to(REPO) else frag.name  # results name no path of this machine
    out: dict = {
        "command": f"python -m tools.eval_quality --q4-1 --fragment-dir {shown}",
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "held_out": held_out_meta(args),
        "runs": [],
    }
    q41 = OfflineModel(args.fragment_dir, max_len=args.seq_len, quantized=Precision.Q4_1)
    ids = held_out_ids(q41.manifest, args)
    n = q41.config.num_layers
    full = perplexity(q41, ids, [])
    out["full_precision_ppl"] = full
    print(f"[quality] full precision (fp32 weights and activations): {full:.6f}", flush=True)

    def run(name: str, model: OfflineModel, layers, activations: str | None, note: str) -> None:
        previous = set_int4_activations(activations or "float32"), set_int4_prefill("float32")
        try:
            if activations is None:
                ppl = perplexity(model, ids, layers)
            else:
                with decode_kernel_everywhere():
                    ppl = perplexity(model, ids, layers)
        finally:
            set_int4_activations(previous[0])
            set_int4_prefill(previous[1])
        row = {
            "config": name,
            "perplexity": ppl,
            "vs_full_pct": 100 * (ppl / full - 1),
            "exactly_full": ppl == full,
            "note": note,
        }
        out["runs"].append(row)
        print(
            f"[quality] {name}: {ppl:.6f} ({row['vs_full_pct']:+.4f}% vs full){' = full' if ppl == full else ''}",
            flush=True,
        )

    every = list(range(n))
    run(
        "q4_1, prefill path (fp32 dequantize + MKL)",
        q41,
        every,
        None,
        "the Q4_1 weights dequantized are the full weights bit for bit",
    )
    run(
        "q4_1, decode kernel, fp32 activations",
        q41,
        every,
        "float32",
        "every token through the INT4 tiles: sum_g d (x.q) + m sum(x), another fp32 summation order",
    )
    run(
        "q4_1, decode kernel, int8 activations",
        q41,
        every,
        "int8",
        "activations quantized per 32 inputs (the served default int4_activations=int8; llama.cpp's Q8 dot products do alike)",
    )
    bytes_q41 = sum(w.nbytes for w in q41.int4)
    bytes_full = sum(w.nbytes for w in q41.full)
    del q41
    awq = OfflineModel(args.fragment_dir, max_len=args.seq_len)
    run("int4 (AWQ), decode kernel, fp32 activations", awq, every, "float32", "the morph rung: a re-quantization")
    run("int4 (AWQ), decode kernel, int8 activations", awq, every, "int8", "the morph rung, served activations")
    bytes_awq = sum(w.nbytes for w in awq.int4)
    del awq
    fp16 = OfflineModel(args.fragment_dir, max_len=args.seq_len, weight_dtype=torch.float16)
    run(
        "full, weights stored in fp16 (fp32 compute)",
        fp16,
        [],
        None,
        "weight_dtype=float16: q*d+m rounded to fp16, so not the GGUF's weights exactly",
    )
    out["layer_bytes"] = {"full_fp32": bytes_full, "q4_1": bytes_q41, "int4_awq": bytes_awq}
    path = _write_check(args, out, ids, t0, "q4_1.json")
    lines = ["| configuration (all 30 layers) | perplexity | vs full |", "|---|---|---|"]
    lines.append(f"| full precision (fp32) | {full:.4f} | |")
    for r in out["runs"]:
        same = " (identical)" if r["exactly_full"] else ""
        lines.append(f"| {r['config']} | {r['perplexity']:.4f} | {r['vs_full_pct']:+.4f}%{same} |")
    (path.parent / "q4_1.md").write_text(
        f"Q4_1 fragments (the GGUF's own 4-bit blocks, fp16 d and m per 32 weights, kept exactly) against full precision "
        f"(the same blocks dequantized to fp32). Perplexity on {out['held_out']['tokens']} held-out tokens (last 10% of "
        f"{Path(args.corpus).name}, {args.windows} windows of {args.seq_len}).\n\n"
        + "\n".join(lines)
        + f"\n\nLayer bytes resident (30 layers): full fp32 {bytes_full / 1e6:.1f} MB, Q4_1 {bytes_q41 / 1e6:.1f} MB, "
        f"AWQ INT4 {bytes_awq / 1e6:.1f} MB.\n\nCommand: `{out['command']}` ({out['seconds']} s, commit {out.get('commit')}).\n"
    )
    print(f"[quality] {out['seconds']} s; wrote {path} and q4_1.md")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.eval_quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--fragment-dir", default=str(default_fragment_dir()))
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "quality"))
    ap.add_argument(
        "--kv-cache-check",
        action="store_true",
        help="only the perplexity with the KV cache stored in fp32 and in fp16 (kv_cache.json)",
    )
    ap.add_argument(
        "--kv-reuse-check",
        action="store_true",
        help="only the cost of reading a prefix's KV written at another precision (kv_reuse.json)",
    )
    ap.add_argument(
        "--storage-check",
        action="store_true",
        help="only the full-precision perplexity with fp32- and fp16-stored weights (storage.json)",
    )
    ap.add_argument(
        "--lm-head",
        action="store_true",
        help="only the INT8 embedding / LM head's cost: perplexity with it full vs INT8 (lm_head.json)",
    )
    ap.add_argument(
        "--int4-activations",
        action="store_true",
        help="only the INT4 decode kernel's int8 vs fp32 activations (int4_activations.json)",
    )
    ap.add_argument(
        "--q4-1",
        action="store_true",
        help="only every layer on its Q4_1 fragment (the GGUF's own blocks) vs full precision (q4_1.json)",
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.q4_1:
        return q4_1_check(args, t0)
    if args.int4_activations:
        return activations_check(args, t0)
    if args.storage_check:
        return storage_check(args, t0)
    if args.kv_cache_check:
        return kv_cache_check(args, t0)
    if args.kv_reuse_check:
        return kv_reuse_check(args, t0)
    if args.lm_head:
        return head_check(args, t0)
    model = OfflineModel(args.fragment_dir, max_len=args.seq_len)
    ids = held_out_ids(model.manifest, args)
    n = model.config.num_layers
    counts = sorted({min(k, n) for k in COUNTS})
    cache: dict[frozenset, float] = {}

    def ppl(layers):
        key = frozenset(layers)
        if key not in cache:
            cache[key] = perplexity(model, ids, list(layers))
        return cache[key]

    table = {}
    for name, order in orders(model, args.seed).items():
        table[name] = {str(k): ppl(order[:k]) for k in counts}
        print(f"[quality] {name:>16}: " + "  ".join(f"k={k}:{table[name][str(k)]:.2f}" for k in counts), flush=True)
    full = table["front-to-back"]["0"]
    lis_order = model.manifest.swap_order()
    curve = {str(k): ppl(lis_order[:k]) for k in range(n + 1)}  # every k, the order serving uses
    took = time.monotonic() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = model.manifest.data.get("swap_order_profile") or {}
    report = {
        "model": model.manifest.data.get("model_name"),
        "held_out": held_out_meta(args) | {"tokens": int(ids[:, 1:].numel())},
        "int4": model.manifest.data.get("quantization", {}).get("int4"),
        "full_precision_ppl": full,
        "by_order": table,
        "serving_order": lis_order,
        "serving_order_is_profiled": bool(profile),
        "profile_seconds": profile.get("seconds"),
        "serving_curve": curve,
        "seconds": round(took, 1),
    }
    (out / "quality.json").write_text(json.dumps(report, indent=1))
    lines = ["| order | " + " | ".join(f"k={k}" for k in counts) + " |", "|---|" + "---|" * len(counts)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[str(k)]:.2f}" for k in counts) + " |")
    md = "\n".join(lines)
    (out / "quality.md").write_text(
        f"Perplexity on {report['held_out']['tokens']} held-out tokens (last 10% of {Path(args.corpus).name}); "
        f"k = INT4 layers (AWQ, group {(report['int4'] or {}).get('group_size')}).\n\n{md}\n\n"
        f"LIS order: {lis_order} (profiling took {profile.get('seconds')} s)\n"
    )
    plot(table, full, out / "quality.png")
    print(md)
    print(f"[quality] serving order {lis_order}; {took:.0f} s; wrote {out}/quality.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
