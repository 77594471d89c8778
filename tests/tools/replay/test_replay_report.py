"""The report side of the replay harness without a server: raw results written and read back, and the committed
comparison rebuilt from its own raw data by `python -m tools.replay.compare --report-only`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tools.replay.client import RequestRecord
from tools.replay.paths import REPO_ROOT
from tools.replay.result import ReplayResult, load_raw, save_raw

COMMITTED = REPO_ROOT / "results" / "replay" / "default"


def test_raw_round_trip(tmp_path):
    rec = RequestRecord(
        0,
        0.5,
        12,
        3,
        send_s=0.51,
        first_token_s=0.9,
        end_s=1.2,
        token_s=[0.912345678, 1.0, 1.2],
        chunk_s=[0.912345678, 1.2],
        int4_layers=[0, 2, 2],
        status="ok",
    )
    res = ReplayResult([rec], [{"t": 0.5, "waiting": 1.0}], [0.2, 0.3], 0.01, 1, (1.5, 2.0))
    save_raw(tmp_path / "int4-15.json", "int4:15", res)
    policy, back = load_raw(tmp_path / "int4-15.json")
    assert policy == "int4:15"
    assert back.records[0].token_s == [0.9123, 1.0, 1.2]  # kept to 0.1 ms
    assert back.records[0].int4_layers == [0, 2, 2] and back.records[0].status == "ok"
    assert (back.samples, back.unloaded_ttft_s, back.metrics_errors) == (res.samples, res.unloaded_ttft_s, 1)
    assert tuple(back.load_avg) == (1.5, 2.0)


def test_committed_report_rebuilds_from_its_raw_data(tmp_path):
    if not (COMMITTED / "raw").is_dir():
        pytest.skip("no committed replay results")
    out = tmp_path / "default"
    shutil.copytree(COMMITTED / "raw", out / "raw")
    if (COMMITTED / "raw_sweep").is_dir():
        shutil.copytree(COMMITTED / "raw_sweep", out / "raw_sweep")
    for name in ("run.json", "sweep.json", "sweep.md", "notes.md"):
        if (COMMITTED / name).exists():
            shutil.copy(COMMITTED / name, out / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.replay.compare",
            "--name",
            "default",
            "--out-root",
            str(tmp_path),
            "--report-only",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The same numbers as the committed summary: the report code reads the raw data as it did when committed.
    assert json.loads((out / "summary.json").read_text()) == json.loads((COMMITTED / "summary.json").read_text())
    report = (out / "report.md").read_text()
    assert "# report rebuilt: python -m tools.replay.compare --name default" in report
    # The committed report.md, narrative included, is what its data produce now: it cannot describe another run.
    rebuilt = [line for line in report.splitlines() if not line.startswith("# report rebuilt:")]
    committed = [
        line for line in (COMMITTED / "report.md").read_text().splitlines() if not line.startswith("# report rebuilt:")
    ]
    assert rebuilt == committed, "results/replay/default/report.md is stale: rebuild it with --report-only"
    assert "Stale notes" not in report
    assert (out / "ttft_cdf.png").stat().st_size > 0 and (out / "timeline_balanced.png").stat().st_size > 0
