"""Capacity by search (docs/capacity.md): for each traffic kind, KV pool size and policy, the highest arrival-rate
scale at which at least 90% of requests meet the fixed SLOs, by bisection per seed; then report.md,
capacity.json and the plots. Resumable: every probe's raw result is kept and a rerun skips it (--force redoes).

    OMP_WAIT_POLICY=PASSIVE python -m tools.capacity                       # the full plan (hours)
    python -m tools.capacity --traffic conv --pools 256 --policies full,balanced --seeds 0,1,2
    python -m tools.capacity --report-only                                 # rebuild the report from raw/
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path

from tools.capacity.overload import DEFAULT_FACTOR
from tools.capacity.plan import Plan
from tools.capacity.slo import Slos
from tools.capacity.traffic import kinds
from tools.replay.paths import repo_path

FULL_POLICIES = "full,balanced,accuracy,performance,int4,int4:10,int4:20"
FULL_POOLS = "256,512,1024,2048,4096,8192"


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected integers separated by commas, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{what}: empty")
    return out


def _param(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--param expects NAME=VALUE, got {text!r}")
    return name, value


def _remember(out: Path, command: str) -> None:
    """The measuring commands, in order, for the report (a rerun of the same command is listed once)."""
    path = out / "commands.txt"
    seen = path.read_text().splitlines() if path.exists() else []
    if command not in seen:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(seen + [command]) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.capacity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--traffic", default="conv,code", help="traffic kinds (tools/capacity/traffic.py)")
    ap.add_argument(
        "--pools",
        default=FULL_POOLS,
        type=lambda t: _ints(t, "--pools"),
        help="max_tokens_in_paged_kv_cache values (tokens)",
    )
    ap.add_argument("--policies", default=FULL_POLICIES)
    ap.add_argument(
        "--seeds", default="0,1,2", type=lambda t: _ints(t, "--seeds"), help="thinning seeds (>= 3 for an interval)"
    )
    ap.add_argument(
        "--thin", type=float, help="a variant of each kind thinned to this share (stored apart; with --min-requests)"
    )
    ap.add_argument("--min-requests", type=int, default=200, help="with --thin: the fewest requests a probe may have")
    ap.add_argument("--start-rate", type=float, help="rate scale every search starts at (default: the kind's)")
    ap.add_argument("--precision", type=float, default=0.05, help="bisection stops at hi/lo <= 1 + this")
    ap.add_argument("--max-probes", type=int, default=12, help="per policy and seed")
    ap.add_argument(
        "--warm-bracket",
        action="store_true",
        help="seeds after the first bracket in steps of the precision around the previous seed's capacity "
        "(off by default: stored searches made without it replay unchanged)",
    )
    ap.add_argument(
        "--overload",
        type=float,
        default=DEFAULT_FACTOR,
        help="after each seed's searches, probe every policy at this multiple of full's capacity "
        "(issue 12's overload targets; 0: not)",
    )
    ap.add_argument(
        "--overload-only",
        action="store_true",
        help="search full's capacity alone (stored probes are reused), then probe every policy once at "
        "the --overload multiple of it: the overload comparison without the other searches",
    )
    ap.add_argument(
        "--repeat-nearest",
        type=int,
        default=0,
        metavar="K",
        help="after each seed's search, run the probes either side of each capacity K more times "
        "(the within-seed noise, in the report; capacities still come from the search alone)",
    )
    ap.add_argument("--param", action="append", default=[], type=_param, help="server parameter NAME=VALUE")
    ap.add_argument("--ttft-slo-s", type=float, default=Slos().ttft_s, help="keep the default across commits")
    ap.add_argument("--tpot-slo-s", type=float, default=Slos().tpot_s, help="keep the default across commits")
    ap.add_argument("--out", default="results/replay/capacity", help="report folder (raw/ inside)")
    ap.add_argument(
        "--json",
        help="the run's figures as numbers (default: OUT/capacity.json; "
        "results/replay/capacity.json gathers every run's: python -m tools.capacity.summary)",
    )
    ap.add_argument("--quality", default="results/quality/quality.json")
    ap.add_argument("--force", action="store_true", help="run probes again even if stored")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-report", action="store_true", help="measure only")
    ap.add_argument("--progress", action="store_true", help="a progress bar per probe")
    args = ap.parse_args(argv)
    out = repo_path(args.out)
    command = "python -m tools.capacity " + shlex.join(argv if argv is not None else sys.argv[1:])
    if not args.report_only:
        try:
            traffic = kinds(args.traffic)
            if args.thin is not None:
                traffic = [t.variant(args.thin, args.min_requests) for t in traffic]
            if args.start_rate is not None:
                traffic = [replace(t, start_rate_scale=args.start_rate) for t in traffic]
            plan = Plan(
                traffic,
                args.pools,
                [p.strip() for p in args.policies.split(",") if p.strip()],
                args.seeds,
                out,
                dict(args.param),
                Slos(args.ttft_slo_s, args.tpot_slo_s),
                args.precision,
                args.max_probes,
                args.force,
                args.progress,
                args.warm_bracket,
                args.overload or None,
                args.repeat_nearest,
                args.overload_only,
            )
        except ValueError as exc:
            ap.error(str(exc))
        _remember(out, command)
        # NOTE: a stopped plan must stop its servers (ExitStack): SIGTERM exits through Python, and SIGINT works
        # even when a shell started the plan in the background with SIGINT ignored.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            plan.run()
        except ValueError as exc:  # a server that cannot hold the traffic (plan.check_starting_kv)
            print(f"python -m tools.capacity: error: {exc}", file=sys.stderr)
            return 2
    if not args.no_report:
        from tools.capacity.report import write_report  # matplotlib only when a report is written

        write_report(
            out, repo_path(args.json) if args.json else out / "capacity.json", repo_path(args.quality), command
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
