"""The comparison runner's --quick mode end to end: two real servers (full, balanced), one short bursty window
of the Azure code trace, the report and its files. Checks that the instrument works, not the results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT

TRACE = ROOT / ".." / "shared" / "data" / "traces" / "azure_llm_code_2023.csv"

pytestmark = [pytest.mark.needs_model, pytest.mark.server]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    if not TRACE.exists():
        pytest.skip("Azure trace not present (../shared/data/traces)")
    out_root = tmp_path_factory.mktemp("replay")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "tools.replay.compare", "--quick", "--out-root", str(out_root), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_root / "quick", proc.stdout


def test_report_files(quick_report):
    out, stdout = quick_report
    for name in (
        "report.md",
        "summary.json",
        "ttft_cdf.png",
        "timeline_full.png",
        "timeline_balanced.png",
        "raw/full.json",
        "raw/balanced.json",
    ):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "python -m tools.replay.compare --quick" in report  # the exact command
    assert "| full |" in report and "| balanced |" in report and "SLO violations cut" in report
    assert "rate x0.05" in report and "clipped to" in report  # the scaling used is stated
    assert str(ROOT) not in report  # no machine paths
    commit = json.loads((out / "run.json").read_text())["commit"]  # HEAD when it ran (others may commit since)
    assert subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT).returncode == 0
    assert f"commit {commit[:7]}" in report and "## Reading" in report  # the run's code, and the generated reading
    assert "[compare] report:" in stdout


def test_every_request_accounted(quick_report):
    out, _ = quick_report
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("full", "balanced"):
        raw = json.loads((out / "raw" / f"{policy}.json").read_text())
        recs = raw["records"]
        s = summary[policy]
        assert s["requests"] == len(recs) > 0
        assert s["completed"] + s["rejected"] + s["failed"] == s["requests"]
        assert s["completed"] >= 1 and s["ttft"]["p50"] > 0
        assert len(raw["unloaded_ttft_s"]) >= 1 and raw["samples"], "probe and metrics timeline"
        for r in recs:
            assert r["status"] in ("ok", "rejected", "error", "unfinished")
            if r["status"] == "ok":
                # Forced output length; one INT4 count per token; times in order.
                assert len(r["token_s"]) == r["max_tokens"] == len(r["int4_layers"])
                eps = 1e-4  # records keep times rounded to 0.1 ms
                assert r["send_s"] <= r["first_token_s"] + eps and r["first_token_s"] <= r["token_s"][-1] + eps
                assert r["token_s"][-1] <= r["end_s"] + eps
        if policy == "full":
            assert all(k == 0 for r in recs for k in r["int4_layers"])
            assert s["full_precision_share"] == 1.0
        assert {"waiting", "int4_layers", "kv_blocks"} <= set(raw["samples"][-1])


def test_report_only_rebuilds(quick_report):
    out, _ = quick_report
    (out / "report.md").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "tools.replay.compare", "--quick", "--out-root", str(out.parent), "--report-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| balanced |" in (out / "report.md").read_text()
