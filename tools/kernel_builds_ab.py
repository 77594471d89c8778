"""Decode steps of two or more builds of the C++ kernels, one process per build, in turn: what a kernel change
did where it has no runtime switch (bench_engine's --*-ab flags switch the ones that have one). With `--tree`,
two or more checkouts of the code instead (e.g. `git worktree add --detach ../before <commit>`), each process
running its own tree's Python on the same kernels library: whether a change of the Python made decode slower.

    python -m plugins.cpu_kernels && cp build/kernels/morphserve_kernels.so /tmp/after.so   # and a /tmp/before.so
    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.kernel_builds_ab \\
        --lib /tmp/before.so --lib /tmp/after.so --context 1024 --batch 1 --pairs 3 [--json FILE]

    python -m tools.kernel_builds_ab --tree ../before --tree . --context 1024 --batch 1 --pairs 5

Each process loads one library and every policy's engine at once (full and all-INT4 by default), admits `batch`
requests of about `context` tokens, times decode steps with the engines taking turns, and prints the median
step per policy with the read bandwidth. Builds alternate process by process, `pairs` times, so the host's drift
hits each; per pair the first build's step over each other's, reported as the median pair [lowest, highest].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from plugins import cpu_kernels
from tools.replay.paths import REPO_ROOT, shown
from tools.replay.provenance import code_version, now_utc


def worker(lib: str, policies: list[str], context: int, batch: int, steps: int, weight_dtype: str) -> dict:
    """In this process (started with MORPHSERVE_KERNELS_LIBRARY=lib): the policies' engines taking turns; median
    step seconds per policy."""
    import torch

    from engines.build_fragments import default_fragment_dir
    from tools import bench_engine

    if cpu_kernels.ops() is None:
        raise SystemExit(f"[builds] {lib} does not load (see the warning above)")
    args = argparse.Namespace(
        fragment_dir=str(default_fragment_dir()),
        batches=[batch],
        weight_dtype=weight_dtype,
        threads=None,
        int4_prefill="auto",
        kv_cache_dtype="auto",
    )
    engines = {p: bench_engine.make_engine(args, p) for p in policies}
    with torch.inference_mode():
        for e in engines.values():
            bench_engine.start_decode(e, batch, max_tokens=steps + 8, context=context)
        step_s = bench_engine.steps_taking_turns(engines, steps)
    return {"lib": lib, "step_s": step_s, "bandwidth_GBps": bench_engine.read_bandwidth() / 1e9}


def tree_label(tree: str) -> str:
    """A checkout named by its folder and commit, the label its runs and ratios carry."""
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{Path(tree).resolve().name}@{head.stdout.strip() or '?'}"


def run_pairs(
    libs: list[str],
    policies: list[str],
    context: int,
    batch: int,
    steps: int,
    pairs: int,
    weight_dtype: str,
    trees: list[str] | None = None,
) -> dict:
    """`libs` compared in this checkout, or (with `trees`) the checkouts compared on the one library libs[0]."""
    sides = (
        [(tree_label(t), libs[0], str(Path(t).resolve())) for t in trees]
        if trees
        else [(Path(lib).name, lib, None) for lib in libs]
    )
    runs = []
    for pair in range(pairs):
        for name, lib, tree in sides:
            env = {**os.environ, "MORPHSERVE_KERNELS_LIBRARY": lib}
            if tree:  # the worker imports that tree's code (an editable install would import this one's)
                env["PYTHONPATH"] = tree
            cmd = [
                sys.executable,
                "-m",
                "tools.kernel_builds_ab",
                "--worker",
                "--lib",
                lib,
                "--policy",
                *policies,
                "--context",
                str(context),
                "--batch",
                str(batch),
                "--steps",
                str(steps),
                "--weight-dtype",
                weight_dtype,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
            if out.returncode != 0:
                raise SystemExit(f"[builds] {name} failed:\n{out.stderr[-2000:]}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run.update(pair=pair, side=name)
            runs.append(run)
            print(
                f"[builds] pair {pair + 1} {name:>28}: "
                + "  ".join(f"{p} {run['step_s'][p] * 1e3:7.2f} ms" for p in policies)
                + f"  read {run['bandwidth_GBps']:.1f} GB/s",
                flush=True,
            )
    ratios = {}
    for i, (name, _, _) in enumerate(sides[1:], start=1):
        for p in policies:
            r = sorted(a["step_s"][p] / b["step_s"][p] for a, b in zip(runs[0 :: len(sides)], runs[i :: len(sides)]))
            ratios[f"{name} {p}"] = {"median": statistics.median(r), "low": r[0], "high": r[-1]}
            print(
                f"[builds] {sides[0][0]} step / {name} step, {p}: {statistics.median(r):.2f}x "
                f"[{r[0]:.2f}, {r[-1]:.2f}] over {len(r)} pairs (context {context}, batch {batch})"
            )
    return {"runs": runs, "first_over_other": ratios}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", help="a built morphserve_kernels.so (repeat: 2 or more)")
    ap.add_argument(
        "--tree", action="append", help="a checkout of the code (repeat: 2 or more), run on one --lib (default: ours)"
    )
    ap.add_argument("--policy", nargs="+", default=["full", "int4"])
    ap.add_argument("--context", type=int, default=0, help="prompt tokens per request (0: a short sentence)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per policy and process")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--weight-dtype", default="float16", choices=["float32", "float16"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.lib[0], args.policy, args.context, args.batch, args.steps, args.weight_dtype)))
        return 0
    if args.tree:
        if len(args.tree) < 2 or len(args.lib or []) > 1:
            ap.error("give two or more --tree checkouts and at most one --lib")
        args.lib = args.lib or [str(cpu_kernels.library_path())]
        missing = [t for t in args.tree if not (Path(t) / "trtllm_backend").is_dir()]
        if missing:
            ap.error(f"not a checkout of this project: {', '.join(missing)}")
    elif len(args.lib or []) < 2:
        ap.error("give two or more --lib builds to compare")
    missing = [lib for lib in args.lib if not Path(lib).is_file()]
    if missing:
        ap.error(f"no such library: {', '.join(missing)}")
    run = {
        "command": "python -m tools.kernel_builds_ab " + " ".join(sys.argv[1:] if argv is None else argv),
        **code_version(),
        "run_utc": now_utc(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    result = run_pairs(
        args.lib, args.policy, args.context, args.batch, args.steps, args.pairs, args.weight_dtype, trees=args.tree
    )
    if args.json:
        for r in result["runs"]:  # a committed result names no path of the machine it ran on
            r["lib"] = portable_path(r["lib"])
        Path(args.json).write_text(json.dumps({**run, **result}, indent=1))
    return 0


def portable_path(path: str) -> str:
    """`path` relative to the repository when it lies inside it (paths.shown), else only its file name."""
    p = Path(path).resolve()
    return shown(p) if p.is_relative_to(REPO_ROOT) else p.name


if __name__ == "__main__":
    sys.exit(main())
