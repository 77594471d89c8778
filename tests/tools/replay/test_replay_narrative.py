"""tools.replay.narrative: the report's reading is computed from the run's data (checked on the committed run
against its summary.json), and a note citing a figure the data do not contain is caught."""

import json
import math

import pytest

from tools.replay import metrics as rm
from tools.replay import narrative, tables
from tools.replay.paths import REPO_ROOT
from tools.replay.quality import load_quality
from tools.replay.report import sweep_data
from tools.replay.result import load_raw

COMMITTED = REPO_ROOT / "results" / "replay" / "default"


@pytest.fixture(scope="module")
def committed():
    if not (COMMITTED / "raw").is_dir():
        pytest.skip("no committed replay results")
    results = dict(load_raw(p) for p in sorted((COMMITTED / "raw").glob("*.json")))
    probes = [t for r in results.values() for t in r.unloaded_ttft_s]
    slo = rm.Slo(rm.default_ttft_slo(probes))
    ppl_at, _ = load_quality(REPO_ROOT / "results" / "quality" / "quality.json")
    rows = [tables.make_row(p, r, slo, slo, ppl_at) for p, r in results.items()]
    return rows, results, slo, sweep_data(COMMITTED)


def test_reading_carries_the_summary_figures(committed):
    rows, results, slo, sweep = committed
    text = narrative.reading(rows, results, slo, sweep)
    summary = json.loads((COMMITTED / "summary.json").read_text())
    for policy, s in summary.items():
        line = next(line for line in text.splitlines() if line.startswith(f"- **{policy}**:"))
        missed = round(s["slo_violation_rate"] * s["requests"])
        assert f"{missed} of {s['requests']} requests miss the {s['slo']['ttft_s']:.2f} s TTFT SLO" in line
        assert f"P95 TTFT {s['ttft']['p95']:.2f} s" in line
        if policy != "full" and not math.isnan(s["quality_loss"]):
            assert f"perplexity {s['quality_loss']:+.2%}" in line


def test_reading_carries_the_sweep_figures(committed):
    rows, results, slo, sweep = committed
    if sweep is None:
        pytest.skip("no committed sweep")
    text = narrative.reading(rows, results, slo, sweep)
    for policy, rate in sweep["sustained"].items():
        assert f"- Sweep, **{policy}**: sustains x{rate:g}" in text
    ratio = sweep["sustained"]["balanced"] / sweep["sustained"]["full"]
    assert f"balanced against full: x{ratio:.2f}" in text


def test_committed_notes_cite_only_figures_of_the_run(committed):
    report = (COMMITTED / "report.md").read_text()
    generated = report.split("\n## Notes\n")[0]
    assert narrative.unbacked_figures((COMMITTED / "notes.md").read_text(), generated) == []


def test_a_stale_note_is_caught():
    generated = "| full | 12.5% | ... SLO 2.58 s, 4 of 32 requests, x1.00"
    assert narrative.unbacked_figures("the 6 requests that miss the 2.90 s SLO", generated) == ["2.9", "6"]
    assert narrative.unbacked_figures("4 of 32 miss the 2.58 s SLO (12.50%)", generated) == []


def test_arrival_spans():
    assert narrative._spans([27.2, 31.0, 28.5, 137.4, 138.1]) == "27-31, 137-138"
    assert narrative._spans([28.0]) == "28"
