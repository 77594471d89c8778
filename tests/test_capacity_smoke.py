"""tools.capacity end to end against a real server (slow, ~1-2 minutes): one tiny probe of `full` on a thinned
conv variant, then a rerun that must skip it, then the report. Checks that the instrument works, not results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / ".." / "shared" / "data" / "traces" / "azure_llm_conv_2023.csv"

pytestmark = [pytest.mark.needs_model, pytest.mark.server]


def capacity(out: Path, *extra: str) -> subprocess.CompletedProcess:
    # ~15 requests played 60x faster than the trace: a ~10 s window
    cmd = [sys.executable, "-m", "tools.capacity", "--traffic", "conv", "--thin", "0.005", "--min-requests", "5",
           "--start-rate", "0.3", "--pools", "256", "--policies", "full", "--seeds", "0", "--max-probes", "1",
           "--out", str(out), "--json", str(out / "capacity.json"), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_probe_rerun_and_report(tmp_path):
    if not TRACE.exists():
        pytest.skip("Azure conversation trace not present (../shared/data/traces)")
    out = tmp_path / "cap"
    first = capacity(out, "--no-report")
    assert "server ready" in first.stdout and "(ran " in first.stdout
    raw = out / "raw" / "conv-thin0.005" / "pool256" / "full" / "seed0" / "x0.3.json"
    data = json.loads(raw.read_text())
    probe = data["probe"]
    assert probe["slo"] == {"ttft_s": 2.0, "tpot_s": 0.35, "target_attainment": 0.9}
    assert len(data["records"]) == probe["requests"] >= 5 and data["samples"]  # the metrics timeline came too
    assert "time x60" in probe["workload"] and "clipped to" in probe["workload"]  # the scaling is stated
    assert len(probe["load_avg_1m"]) == 2 and probe["commit"] and probe["server_commit"] and probe["server_started_utc"]
    second = capacity(out)  # resumed: the stored probe is read, no server starts
    assert "(stored)" in second.stdout and "server ready" not in second.stdout
    report = (out / "report.md").read_text()
    assert "conv-thin0.005, memory of the full-precision model + 256 KV tokens" in report and "| full |" in report
    assert str(ROOT) not in report  # no machine paths
    assert json.loads((out / "capacity.json").read_text())["cells"][0]["traffic"] == "conv-thin0.005"
