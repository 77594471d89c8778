"""One probe: a traffic kind's requests for one seed, played at one rate scale against a running server, judged
by the fixed SLOs. Returns the replay's raw result and the `probe` block the store keeps beside it."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime, timezone

from tools.capacity.slo import SENSITIVITY, TARGET_ATTAINMENT, Slos, attainment
from tools.capacity.traffic import Traffic
from tools.replay.paths import REPO_ROOT
from tools.replay.prompts import PromptSource
from tools.replay.result import ReplayResult
from tools.replay.runner import replay
from tools.replay.workload import probe_request

# What the server runs: a change here (committed or not) changes what a probe measured.
SERVED_PATHS = ("trtllm_backend", "model_repository", "plugins", "tools/replay", "tools/capacity")


def provenance() -> dict:
    """The commit, and which served paths differed from it when the probe ran (uncommitted work)."""

    def git(*args):  # NOTE: not stripped: porcelain lines start with a status column that may be a space
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout

    dirty = [
        line[3:]
        for line in git("status", "--porcelain", "--", *SERVED_PATHS).splitlines()
        if line.strip() and not line.endswith(".pyc")
    ]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown", "dirty": dirty}


def run_probe(
    traffic: Traffic, rate: float, seed: int, server, prompts: PromptSource, slos: Slos, progress: bool
) -> tuple[ReplayResult, dict]:
    planned, shaping = traffic.planned(rate, seed, prompts)
    drain = slos.drain_s(max(p.output_tokens for p in planned))
    started = datetime.now(timezone.utc)
    where = provenance()  # before the run: what the server was started from, not what HEAD became meanwhile
    load0 = os.getloadavg()
    t = time.monotonic()
    # one unloaded request (after a warm-up) before the window: the machine's speed at this moment
    res = replay(
        planned,
        "grpc",
        server.grpc_url,
        server.metrics_url,
        shaping.duration_s,
        drain,
        progress,
        probe_request(planned, prompts),
        1,
        count_tokens=lambda text: len(prompts.tok.encode(text)),
    )
    load1 = os.getloadavg()
    res.load_avg = (load0[0], load1[0])
    att = attainment(res.records, slos)
    probe = {
        "attained": att >= TARGET_ATTAINMENT,
        "attainment": att,
        "sensitivity": {f"{f:g}": attainment(res.records, slos.scaled(f)) for f in SENSITIVITY},
        "slo": {"ttft_s": slos.ttft_s, "tpot_s": slos.tpot_s, "target_attainment": TARGET_ATTAINMENT},
        "requests": len(planned),
        "window_s": shaping.duration_s,
        "offered_req_s": len(planned) / shaping.duration_s,
        "drain_s": drain,
        "traffic_described": traffic.describe(),
        "workload": shaping.describe(),
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.monotonic() - t, 1),
        "load_avg_1m": [round(load0[0], 2), round(load1[0], 2)],
        "load_avg_5m_end": round(load1[1], 2),
        "cpus": os.cpu_count(),
        **where,
    }
    return res, probe
