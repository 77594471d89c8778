"""Fleet sizing for MorphServe on GPUs, computed from this project's own measurements (docs/scale-out.md).

    python deploy/sizing.py                      # the tables of docs/scale-out.md, as Markdown
    python deploy/sizing.py --json               # the same numbers as JSON

Measured here (inputs): the per-layer fragment sizes of the served model (its manifest.json: full-precision and
INT4 bytes, and the model's shape), the engine's swap prepare/apply times (results/engine/bench_engine.json) and the
Azure LLM traces' arrivals and token counts. Computed (outputs): the same quantities for a 7-8B model's
shapes on a GPU, and how long the KV headroom a morph frees holds a burst's excess before requests queue.
Nothing here ran on a GPU: every GPU-side number is arithmetic on the measured ratios plus the assumptions
named in ASSUMPTIONS.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "model_repository" / "smollm2" / "1" / "fragments" / "manifest.json"
BENCH = ROOT / "results" / "engine" / "bench_engine.json"
TRACES = ROOT.parent / "shared" / "data" / "traces"

GB = 1e9
ASSUMPTIONS = {
    "gpu_memory_utilization": 0.90,  # share of GPU memory the server may use (vLLM's and TRT-LLM's usual 0.9)
    "activation_reserve_bytes": 2e9,  # activations, CUDA context and workspace, kept out of the KV pool
    "pcie_bytes_per_s": 25e9,  # host-to-device copy of a staged INT4 fragment (PCIe Gen4 x16, effective)
    "kv_dtype_bytes": 2,  # fp16 K/V on the GPU
    "weight_dtype_bytes": 2,  # fp16 full-precision weights on the GPU
}


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's shape (the architecture the engine serves)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    def layer_params(self) -> int:
        """q, k, v, o projections, gate/up/down MLP and the two RMSNorm weights of one decoder layer."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def shared_params(self) -> int:
        """Embedding, LM head (unless tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# The paper's model class: a 7-8B Llama. Llama-3.1-8B (grouped KV heads) and Llama-2-7B (one KV head per query
# head: 4x the KV bytes per token, so a swapped layer buys 4x fewer tokens).
MODELS = {
    "Llama-3.1-8B": Shape(4096, 14336, 32, 32, 8, 128, 128256),
    "Llama-2-7B": Shape(4096, 11008, 32, 32, 32, 128, 32000),
}
GPUS = {"L4 24 GB": 24 * GB, "L40S 48 GB": 48 * GB, "H100 80 GB": 80 * GB}


class SizingError(ValueError):
    """An input file is missing or does not hold what the sizing needs (the message names it)."""


def _load_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise SizingError(
            f"{what} not found: {path} ({'run tools/setup.sh' if 'manifest' in what else 'run make bench'})"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SizingError(f"{what} {path} is not JSON: {exc}") from exc


def measured_model(manifest_path: Path = MANIFEST) -> dict:
    """Per-layer sizes of the served model, from its fragment manifest (bytes as stored, headers included)."""
    m = _load_json(manifest_path, "fragment manifest")
    try:
        c = m["config"]
        shape = Shape(
            c["hidden_size"],
            c["intermediate_size"],
            c["num_layers"],
            c["num_heads"],
            c["num_kv_heads"],
            c["head_dim"],
            c["vocab_size"],
            bool(c.get("tie_word_embeddings")),
        )
        full = [layer["fragments"]["full"] for layer in m["layers"]]
        int4 = [layer["fragments"]["int4"] for layer in m["layers"]]
    except KeyError as exc:
        raise SizingError(f"{manifest_path}: no {exc} (a manifest with full and int4 fragments is needed)") from exc
    full_bytes = statistics.mean(f["bytes"] for f in full)
    int4_bytes = statistics.mean(f["bytes"] for f in int4)
    params = shape.layer_params()
    full_dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[full[0].get("dtype", "float32")]
    return {
        "name": m.get("model_name", "?"),
        "shape": asdict(shape),
        "layer_params": params,
        "full_dtype": full[0].get("dtype", "float32"),
        "full_bytes": full_bytes,
        "int4_bytes": int4_bytes,
        "int4_group_size": int4[0].get("group_size"),
        # Measured INT4 storage per parameter (packed nibbles + scales/zeros + norms + file header).
        "int4_bytes_per_param": int4_bytes / params,
        "full_bytes_per_param": full_bytes / params,
        "full_dtype_bytes": full_dtype_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token(full_dtype_bytes),
        "kv_tokens_per_swap": (full_bytes - int4_bytes) / shape.kv_bytes_per_token(full_dtype_bytes),
    }


def measured_swaps(bench_path: Path = BENCH) -> dict:
    b = _load_json(bench_path, "engine benchmark")
    try:
        prepare, apply = b["swap"]["prepare_s"], b["swap"]["apply_s"]
    except KeyError as exc:
        raise SizingError(f"{bench_path}: no swap timings ({exc})") from exc
    if not prepare or not apply:
        raise SizingError(f"{bench_path}: empty swap timings")
    return {"prepare_s": statistics.mean(prepare), "apply_s": statistics.mean(apply), "samples": len(prepare)}


def gpu_model(name: str, shape: Shape, measured: dict, swaps: dict, gpu_bytes: float) -> dict:
    """One model on one GPU: weights, the KV pool at full precision and after swapping k layers to INT4."""
    a = ASSUMPTIONS
    layer_fp16 = shape.layer_params() * a["weight_dtype_bytes"]
    layer_int4 = shape.layer_params() * measured["int4_bytes_per_param"]
    freed = layer_fp16 - layer_int4
    weights = (shape.layer_params() * shape.layers + shape.shared_params()) * a["weight_dtype_bytes"]
    kv_token = shape.kv_bytes_per_token(a["kv_dtype_bytes"])
    pool = gpu_bytes * a["gpu_memory_utilization"] - weights - a["activation_reserve_bytes"]
    # The CPU prepare rate measured here (read, verify, lay out an INT4 fragment) bounds a swap from above;
    # the host-to-device copy of the staged fragment bounds it from below.
    cpu_rate = measured["int4_bytes"] / swaps["prepare_s"]
    by_k = {}
    for k in (0, 8, 16, (2 * shape.layers) // 3, shape.layers):
        tokens = max(0.0, pool + k * freed) / kv_token
        by_k[k] = tokens
    return {
        "model": name,
        "gpu_bytes": gpu_bytes,
        "layer_fp16_bytes": layer_fp16,
        "layer_int4_bytes": layer_int4,
        "freed_per_swap_bytes": freed,
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "kv_tokens_per_swap": freed / kv_token,
        "kv_pool_bytes": pool,
        "kv_tokens_by_int4_layers": by_k,
        "swap_prepare_s_upper": layer_int4 / cpu_rate,
        "swap_prepare_s_lower": layer_int4 / a["pcie_bytes_per_s"],
        "balanced_max_int4": (2 * shape.layers) // 3,
    }


def trace_stats(path: Path, bin_s: float = 10.0, burst_factor: float = 1.5) -> dict:
    """Arrivals and token counts of an Azure LLM trace; bursts = runs of `bin_s` bins above burst_factor x mean."""
    if not path.exists():
        raise SizingError(f"trace not found: {path}")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= rows[0].keys():
        raise SizingError(f"{path}: expected columns TIMESTAMP, ContextTokens, GeneratedTokens")
    t = [dt.datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    secs = [(x - t[0]).total_seconds() for x in t]
    span = secs[-1]
    bins = [0] * (int(span // bin_s) + 1)
    for s in secs:
        bins[int(s // bin_s)] += 1
    rates = [n / bin_s for n in bins]
    mean = len(rows) / span
    bursts, run = [], []
    for r in rates + [0.0]:
        if r > burst_factor * mean:
            run.append(r)
        elif run:
            bursts.append((len(run) * bin_s, statistics.mean(run)))
            run = []
    prompt = [int(r["ContextTokens"]) for r in rows]
    out = [int(r["GeneratedTokens"]) for r in rows]
    q = statistics.quantiles(rates, n=100)
    durs = sorted(d for d, _ in bursts)
    return {
        "trace": path.name,
        "requests": len(rows),
        "span_s": span,
        "mean_rate": mean,
        "rate_p50": q[49],
        "rate_p90": q[89],
        "rate_p99": q[98],
        "rate_max": max(rates),
        "bin_s": bin_s,
        "bursts": len(bursts),
        "burst_factor": burst_factor,
        "burst_duration_p50_s": durs[len(durs) // 2] if durs else 0.0,
        "burst_duration_p90_s": durs[int(len(durs) * 0.9)] if durs else 0.0,
        "burst_duration_max_s": durs[-1] if durs else 0.0,
        "burst_mean_rate": statistics.mean(r for _, r in bursts) if bursts else 0.0,
        "prompt_mean": statistics.mean(prompt),
        "prompt_p50": statistics.median(prompt),
        "output_mean": statistics.mean(out),
        "output_p50": statistics.median(out),
    }


def cover_seconds(
    extra_tokens_per_replica: float, replicas: int, excess_rate: float, tokens_per_request: float
) -> float:
    """Seconds the fleet's extra KV holds a burst's excess arrivals before they must queue, counting none of
    them as finished (a lower bound: requests that finish inside the window give their blocks back)."""
    if excess_rate <= 0:
        return float("inf")
    return replicas * extra_tokens_per_replica / (excess_rate * tokens_per_request)


def report(manifest: Path = MANIFEST, bench: Path = BENCH, traces: Path = TRACES) -> dict:
    measured = measured_model(manifest)
    swaps = measured_swaps(bench)
    gpus = [gpu_model(n, s, measured, swaps, g) for n, s in MODELS.items() for g in GPUS.values()]
    for row, gname in zip(gpus, [g for _ in MODELS for g in GPUS]):
        row["gpu"] = gname
    stats = [trace_stats(traces / f"azure_llm_{k}_2023.csv") for k in ("code", "conv")]
    r = {"assumptions": ASSUMPTIONS, "measured": measured, "swaps": swaps, "gpus": gpus, "traces": stats}
    r["coverage"] = coverage(r)
    return r


def markdown(r: dict) -> str:
    m, s = r["measured"], r["swaps"]
    lines = [
        f"Measured ({m['name']}, {m['shape']['layers']} layers, full precision {m['full_dtype']}, INT4 group "
        f"{m['int4_group_size']}): a layer is {m['full_bytes'] / 1e6:.2f} MB full, {m['int4_bytes'] / 1e6:.2f} MB INT4 "
        f"({m['int4_bytes_per_param']:.3f} bytes/parameter); a swap frees room for {m['kv_tokens_per_swap']:.0f} "
        f"tokens of KV ({m['kv_bytes_per_token']} B/token); swap prepare {s['prepare_s'] * 1e3:.1f} ms, apply "
        f"{s['apply_s'] * 1e3:.1f} ms (mean of {s['samples']}).",
        "",
        "| model | GPU | layer fp16 / INT4 (MB) | KV per token (KiB) | tokens per swapped layer | KV pool at full precision (tokens) "
        "| + balanced max INT4 layers | x | swap prepare (s, lower-upper) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in r["gpus"]:
        by_k = g["kv_tokens_by_int4_layers"]
        k = g["balanced_max_int4"]
        base = by_k[0]
        ratio = f"{by_k[k] / base:.2f}" if base > 0 else "n/a (weights do not fit)"
        lines.append(
            f"| {g['model']} | {g['gpu']} | {g['layer_fp16_bytes'] / 1e6:.0f} / {g['layer_int4_bytes'] / 1e6:.0f} "
            f"| {g['kv_bytes_per_token'] / 1024:.0f} | {g['kv_tokens_per_swap']:.0f} | {base:,.0f} "
            f"| {by_k[k]:,.0f} ({k} layers) | {ratio} | {g['swap_prepare_s_lower']:.3f}-{g['swap_prepare_s_upper']:.2f} |"
        )
    lines += [
        "",
        "| trace | requests | mean req/s | 10-s rate p50 / p90 / p99 / max | bursts (> 1.5x mean) "
        "| burst length p50 / p90 / max (s) | prompt mean / p50 | output mean / p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r["traces"]:
        lines.append(
            f"| {t['trace']} | {t['requests']} | {t['mean_rate']:.2f} | {t['rate_p50']:.1f} / {t['rate_p90']:.1f} / "
            f"{t['rate_p99']:.1f} / {t['rate_max']:.1f} | {t['bursts']} | {t['burst_duration_p50_s']:.0f} / "
            f"{t['burst_duration_p90_s']:.0f} / {t['burst_duration_max_s']:.0f} | {t['prompt_mean']:.0f} / "
            f"{t['prompt_p50']:.0f} | {t['output_mean']:.0f} / {t['output_p50']:.0f} |"
        )
    lines += [
        "",
        "Seconds the extra KV of a balanced morph (max INT4 layers) holds a burst's excess over the trace's mean "
        "rate before requests queue, for M replicas of Llama-3.1-8B (lower bound: no request finishes meanwhile; "
        "tokens per request = mean prompt + mean output; the extra KV is the same on every GPU size):",
        "",
        "| trace, excess over the mean rate | extra KV per replica (tokens) | M = 2 | M = 4 | M = 8 |",
        "|---|---|---|---|---|",
    ]
    for row in r["coverage"]:
        lines.append(
            f"| {row['trace']}, {row['label']} +{row['excess_rate']:.1f} req/s | {row['extra_tokens']:,.0f} | "
            + " | ".join(f"{row['seconds'][m]:.0f} s" for m in (2, 4, 8))
            + " |"
        )
    return "\n".join(lines)


def coverage(r: dict) -> list[dict]:
    rows = []
    for t in r["traces"]:
        per_request = t["prompt_mean"] + t["output_mean"]
        for label, rate in (("burst mean", t["burst_mean_rate"]), ("10-s p99", t["rate_p99"])):
            excess = rate - t["mean_rate"]
            # Any GPU row of the model: the freed bytes do not depend on the GPU (its pool does).
            g = next(g for g in r["gpus"] if g["model"] == "Llama-3.1-8B")
            extra = g["balanced_max_int4"] * g["kv_tokens_per_swap"]
            rows.append(
                {
                    "trace": t["trace"].removesuffix("_2023.csv").removeprefix("azure_llm_"),
                    "label": label,
                    "excess_rate": excess,
                    "extra_tokens": extra,
                    "tokens_per_request": per_request,
                    "seconds": {m: cover_seconds(extra, m, excess, per_request) for m in (2, 4, 8)},
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=MANIFEST)
    ap.add_argument("--bench", type=Path, default=BENCH)
    ap.add_argument("--traces", type=Path, default=TRACES, help="folder with azure_llm_{code,conv}_2023.csv")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        r = report(a.manifest, a.bench, a.traces)
    except SizingError as exc:
        print(f"sizing: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1, default=str) if a.json else markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
