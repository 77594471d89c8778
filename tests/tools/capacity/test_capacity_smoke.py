"""tools.capacity end to end against a real server (slow, ~1-2 minutes): one tiny probe of `full` on a thinned
conv variant, then a rerun that must skip it, then the report. Checks that the instrument works, not results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

TRACE = ROOT / ".." / "shared" / "data" / "traces" / "azure_llm_conv_2023.csv"

pytestmark = [pytest.mark.needs_model, pytest.mark.server]


# ~15 requests played 60x faster than the trace: a ~10 s window
CONV = ("--traffic", "conv", "--thin", "0.005", "--min-requests", "5", "--pools", "256")


def capacity(out: Path, *extra: str, traffic=CONV) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "tools.capacity",
        *traffic,
        "--start-rate",
        "0.3",
        "--policies",
        "full",
        "--seeds",
        "0",
        "--max-probes",
        "1",
        "--out",
        str(out),
        "--json",
        str(out / "capacity.json"),
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=600
    )
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


def test_a_mixed_chat_probe_keeps_each_requests_class(tmp_path):
    if not TRACE.exists():
        pytest.skip("Azure conversation trace not present (../shared/data/traces)")
    out = tmp_path / "chat"
    # 12 turns of 6 conversations (3 interactive turns) in a 6 s window; a TPOT SLO of 10 ms cuts the drain to
    # ~10 s (the probe fails: it checks the instrument, not the server)
    capacity(
        out,
        "--overload",
        "0",
        "--tpot-slo-s",
        "0.01",
        traffic=("--traffic", "chat-kv-mixed", "--thin", "0.003", "--min-requests", "5", "--pools", "2048"),
    )
    data = json.loads(
        (out / "raw" / "chat-kv-mixed-thin0.003" / "pool2048" / "full" / "seed0" / "x0.3.json").read_text()
    )
    assert sorted(r["priority"] for r in data["records"]) == [0] * 3 + [5] * 9
    assert any("prefix_reused_tokens" in x for x in data["samples"])  # the reuse counter is sampled
    assert "multi-turn" in data["probe"]["traffic_described"]
    report = (out / "report.md").read_text()
    assert "| interactive (0): requests, attainment" in report and "| 0 | 0.3 | full | n/a |" in report
