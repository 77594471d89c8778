"""The machine's read bandwidth by every method of plugins/read_bandwidth.py, at several working-set sizes.

    python -m tools.read_bandwidth [--sizes-mb 1024 512 330 180] [--rounds 3] [--threads N] [--json FILE]

Per size: each method's GB/s (median of its passes, best of the rounds, the methods taking turns) and the floor's
(the fastest). Buffers sit on 2 MiB pages, as the engine's weights do. The run records its load and whether a
pinned measurement (tools.capacity / tools.isolate_server) was running beside it: that disturbs every number here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from plugins.read_bandwidth import METHODS, measure
from tools.replay.provenance import code_version, now_utc
from trtllm_backend import huge_pages


def measurements_beside() -> list[str]:
    """Other pinned measurements running now (their command lines), which share the cores and the memory bus."""
    try:
        out = subprocess.run(["pgrep", "-af", "tools.capacity|isolate_server"], capture_output=True, text=True).stdout
    except OSError:
        return []
    # their command lines, with any absolute path as <path>: results name no path of this machine
    return [
        " ".join("<path>" if a.startswith("/") else a for a in line.split(" ")[1:])
        for line in out.splitlines()
        if str(os.getpid()) != line.split(" ", 1)[0] and "pgrep" not in line
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.read_bandwidth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1024, 512, 330, 180])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=None, help="'all threads' for the methods that use them (default: torch's)"
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    beside = measurements_beside()
    run = {
        "command": "python -m tools.read_bandwidth " + " ".join(sys.argv[1:] if argv is None else argv),
        **code_version(),
        "run_utc": now_utc(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "measurements_beside": beside,
        "sizes": [],
    }
    if beside:
        print(f"[bandwidth] NOTE: measured beside {len(beside)} other measurement process(es): {beside}")
    print(
        f"[bandwidth] {torch.get_num_threads()} threads; 2 MiB pages: {huge_pages.unavailable_reason() or 'yes'}; "
        f"median of {args.reps} passes, best of {args.rounds} rounds, GB/s"
    )
    print(f"{'MB':>6} " + " ".join(f"{m:>20}" for m in METHODS) + f" {'floor':>7}  method")
    for mb in args.sizes_mb:
        r = measure(mb << 20, reps=args.reps, threads=args.threads, rounds=args.rounds, alloc=huge_pages.empty)
        run["sizes"].append(r)
        print(
            f"{mb:>6} "
            + " ".join(f"{r['GBps'].get(m, float('nan')):>20.1f}" for m in METHODS)
            + f" {r['floor_GBps']:>7.1f}  {r['floor_method']}",
            flush=True,
        )
    run["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
