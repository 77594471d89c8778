"""The GPU check: the CUDA path exact, fast enough, and morphing at an 8B model's shape, in one run of a few minutes.

    python -m tools.gpu_check --out results/gpu                                  # on a GPU (docs/gpu-check.md)
    python -m tools.gpu_check --device cpu --shapes tiny --out /tmp/gpu_check   # the same script on the CPU

Sections, in order (each recorded in OUT/gpu_check.json as soon as it ends; one that raises is recorded and the run
goes on; one the --budget-s no longer has time for is skipped and recorded so):
    bandwidth             a device-to-device copy: the floor's denominator
    fragments:<shape>     random-weight fragment sets (full and INT4), drawn on the device (synth.py)
    exactness             the engine on the device against the fp32 CPU reference, tiny shape, full and INT4
    decode:<shape>        tok/s at each batch, full and all-INT4, the bandwidth floor beside each
    swaps:<last shape>    every layer swapped down and restored while decoding: stage / bind times, KV, stalls
    burst:<last shape>    full vs balanced at the same memory budget on a small KV pool
Exit status: 0 when no section failed or raised, 1 otherwise, 2 when the device is missing.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from tools.replay.provenance import code_version, now_utc

from . import burst, decode, exactness, swaps, synth
from . import device as dev
from .report import Run
from .shapes import DEFAULT_SHAPES, EXACTNESS_SHAPE, SHAPES, parse_shapes

SECTIONS = ("bandwidth", "exactness", "decode", "swaps", "burst")
# Seconds a section needs on an H100 (estimates, with room; the tiny shape's on the CPU): below it, it is skipped.
NEED_S = {
    "tiny": {"fragments": 5, "decode": 20, "swaps": 20, "burst": 20},
    "smollm2-135m": {"fragments": 20, "decode": 30, "swaps": 60, "burst": 60},
    "llama-3.1-8b": {"fragments": 120, "decode": 90, "swaps": 60, "burst": 90},
}
EXACTNESS_NEED_S = 30


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"decode runs at each, swaps and burst at the last ({', '.join(SHAPES)}; default %(default)s)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="a subset of %(default)s")
    ap.add_argument("--batches", default="1,16,64", help="decode batches (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's seconds (default %(default)s)")
    ap.add_argument("--swap-layers", type=int, help="layers swapped down and restored (default: every layer)")
    ap.add_argument("--bandwidth-mib", type=int, help="the copy's size (default: 1024 on cuda, 256 on cpu)")
    ap.add_argument("--threads", type=int, help="CPU threads for torch and the engines (default: all cores)")
    ap.add_argument("--work-dir", help="where the fragment sets are written (default: a temporary folder, removed)")
    ap.add_argument("--keep-fragments", action="store_true", help="leave the fragment sets in --work-dir")
    ap.add_argument("--commit", help="the commit under test, where the copy has no .git (default: git's HEAD)")
    ap.add_argument(
        "--keep-going",
        action="store_true",
        help="run the later sections even when the exactness section raised (by default they are skipped)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes)
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError as e:
        ap.error(str(e))
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(args.sections) - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dev.require(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    version = code_version()
    run = Run(
        Path(args.out),
        args.budget_s,
        {
            "command": "python -m tools.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv),
            "commit": args.commit or version["commit"],
            "dirty": None if args.commit else version["dirty"],
            "started_utc": now_utc(),
            "device": dev.describe(args.device),
            "seed": args.seed,
            "shapes": [s.describe() for s in args.shapes],
        },
    )
    try:
        _sections(run, args, work)
    finally:
        if not args.keep_fragments:
            shutil.rmtree(work, ignore_errors=True)
    ok = run.finish()
    for name, s in run.data["sections"].items():
        print(f"[gpu_check] {name:28} {s['status']}")
    print(f"[gpu_check] {'all passed' if ok else 'FAILED'} in {run.data['wall_s']} s: {run.path}")
    return 0 if ok else 1


def _sections(run: Run, args, work: Path) -> None:
    device, threads, seed, want = args.device, args.threads, args.seed, set(args.sections)
    # NOTE: an engine that cannot run one tiny request on the device will not run an 8B one: the lease is kept
    # for a rerun instead of spent drawing 16 GB of weights.
    gate = () if args.keep_going else ("exactness",)

    def fragments(name: str) -> str:
        section = f"fragments:{name}"
        if run.status(section) is None:
            run.section(
                section,
                lambda: synth.build_set(work / name, SHAPES[name], device, seed),
                need_s=NEED_S[name]["fragments"],
                not_after=gate if name != EXACTNESS_SHAPE else (),
            )
        return section

    bandwidth = None
    if "bandwidth" in want:
        size = args.bandwidth_mib or (1024 if device == "cuda" else 256)
        bandwidth = run.section("bandwidth", lambda: dev.copy_bandwidth(device, size << 20), need_s=5).get(
            "bytes_per_s"
        )
    if "exactness" in want:
        needs = (fragments(EXACTNESS_SHAPE),)
        run.section(
            "exactness",
            lambda: exactness.run(work / EXACTNESS_SHAPE, device, threads, seed),
            need_s=EXACTNESS_NEED_S,
            needs=needs,
        )
    if "decode" in want:
        for shape in args.shapes:
            needs = (fragments(shape.name),)
            run.section(
                f"decode:{shape.name}",
                lambda: decode.run(work / shape.name, device, threads, args.batches, bandwidth),
                need_s=NEED_S[shape.name]["decode"],
                needs=needs,
                not_after=gate,
            )
    last = args.shapes[-1]
    need = NEED_S[last.name]
    if "swaps" in want:
        needs = (fragments(last.name),)
        reserve = need["burst"] if "burst" in want else 0  # the burst's time is not the swaps' to spend
        run.section(
            f"swaps:{last.name}",
            lambda: swaps.run(work / last.name, device, threads, last, run.deadline(reserve), args.swap_layers, seed),
            need_s=need["swaps"],
            needs=needs,
            not_after=gate,
        )
    if "burst" in want:
        needs = (fragments(last.name),)
        run.section(
            f"burst:{last.name}",
            lambda: burst.run(work / last.name, device, threads, last, run.deadline(), seed),
            need_s=need["burst"],
            needs=needs,
            not_after=gate,
        )


if __name__ == "__main__":
    sys.exit(main())
