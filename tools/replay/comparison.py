"""The comparison: every policy replays the same planned window against a freshly started server with the same
settings, one after another; each run's raw result lands in <out>/raw/<policy>.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tools.replay import metrics as rm
from tools.replay.paths import REPO_ROOT
from tools.replay.provenance import code_version, now_utc
from tools.replay.result import ReplayResult, save_raw
from tools.replay.runner import replay
from tools.replay.servers import Server, slug
from tools.replay.settings import slo_of


def run_policy(policy: str, planned, window_s, args, log_dir: Path) -> ReplayResult:
    load0 = os.getloadavg()[0]
    with Server(policy, args.params, log_dir) as h:
        res = replay(
            planned,
            "grpc",
            h.grpc_url,
            h.metrics_url,
            window_s,
            args.drain_s,
            not args.no_progress,
            args.probe,
            args.probes,
        )
    res.load_avg = (load0, os.getloadavg()[0])
    s = rm.summarize(res.records, slo_of(args, res))
    print(
        f"[compare] {policy}: {s.completed}/{s.requests} completed, unloaded TTFT {rm.dist(res.unloaded_ttft_s).p50:.2f}"
        f" s, SLO {s.slo.ttft_s:.2f} s, violations {s.slo_violation_rate:.1%}, P95 TTFT {s.ttft.p95:.2f} s; "
        f"load average {load0:.1f} -> {res.load_avg[1]:.1f}",
        flush=True,
    )
    return res


def compare(args, out: Path, planned, window_s) -> None:
    """Run every policy in args.policy_list; server logs go to build/replay/<name>/."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    run = {"command": args.command, **code_version()}  # --report-only keeps quoting both
    (out / "run.json").write_text(json.dumps(run))
    for policy in args.policy_list:
        res = run_policy(policy, planned, window_s, args, REPO_ROOT / "build" / "replay" / args.name)
        save_raw(raw / f"{slug(policy)}.json", policy, res)
    (out / "run.json").write_text(json.dumps({**run, "finished": now_utc()}))
