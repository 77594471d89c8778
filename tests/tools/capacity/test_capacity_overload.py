"""The overload comparison (tools/capacity/overload.py, its report section) from hand-made stored probes."""

import json

import pytest

from tests.tools.capacity.capacity_fixtures import put
from tools.capacity import overload, store
from tools.capacity.report import write_report
from tools.capacity.stats import mean_interval

# seed -> (requests within the SLOs out of 100 for full, for balanced) at x1.25 of full's capacity
GOOD = {0: (40, 99), 1: (60, 98), 2: (50, 100)}


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "capacity"
    for seed, (full, bal) in GOOD.items():
        for policy, good in (("full", full), ("balanced", bal)):
            put(out, "conv", 256, policy, seed, 0.1, 100, 95)  # the capacity probe (not overload)
            path = put(out, "conv", 256, policy, seed, 0.125, 100, good)
            store.mark(path, overload_of_full=1.25)
    return out


def test_pairs_cut_and_ttft_ratio_match_hand_calculation(folder):
    found = overload.pairs(folder, "conv", 256, None)
    assert list(found) == [(1.25, "balanced")]
    pairs = found[(1.25, "balanced")]
    assert [p.seed for p in pairs] == [0, 1, 2] and all(p.rate == 0.125 for p in pairs)
    cuts = [1 - (100 - b) / (100 - f) for f, b in GOOD.values()]  # 1 - violations / full's violations
    assert [p.cut for p in pairs] == pytest.approx(cuts)
    s = overload.summary(pairs)
    assert s["cut"].mean == pytest.approx(mean_interval(cuts).mean)
    # fixture: a miss has a 5 s TTFT, a hit 0.5 s; full's P95 is 5 s, balanced's 0.5 s (<= 2% misses)
    assert s["ttft_x"].mean == pytest.approx(10.0)
    assert overload.meets_targets(s) == (mean_interval(cuts).mean >= 0.95, True)


def test_unmarked_probes_and_seeds_without_full_are_left_out(folder):
    put(folder, "conv", 256, "balanced", 3, 0.125, 100, 99)
    store.mark(store.ProbeKey("conv", 256, "balanced", 3, 0.125).path(folder), overload_of_full=1.25)
    assert [p.seed for p in overload.pairs(folder, "conv", 256, None)[(1.25, "balanced")]] == [0, 1, 2]
    assert overload.pairs(folder, "conv", 512, None) == {}


def test_nothing_to_cut_where_full_met_every_slo(tmp_path):
    for policy in ("full", "balanced"):
        store.mark(put(tmp_path, "conv", 256, policy, 0, 0.125, 100, 100), overload_of_full=1.25)
    (pair,) = overload.pairs(tmp_path, "conv", 256, None)[(1.25, "balanced")]
    assert pair.cut is None and overload.summary([pair])["cut"] is None


def test_report_section_and_json(folder, tmp_path):
    quality = tmp_path / "quality.json"
    quality.write_text(json.dumps({"serving_curve": {str(k): 10.0 for k in range(31)}}))
    write_report(folder, tmp_path / "c.json", quality, "cmd")
    text = (folder / "report.md").read_text()
    assert "Overload: `balanced` against `full` at x1.25 of full's capacity" in text
    assert "| 0 | 0.125 | 60.0% -> 1.0% | 98.3% |" in text
    assert "(target >= 95%): **met**" in text and "(target >= 4x): **met**" in text
    cell = json.loads((tmp_path / "c.json").read_text())["cells"][0]
    per_seed = cell["overload"]["1.25"]["balanced"]["per_seed"]
    assert [s["seed"] for s in per_seed] == [0, 1, 2] and per_seed[0]["violations_full"] == pytest.approx(0.6)


def test_share_intervals_stay_within_0_and_1(tmp_path):
    for seed, bal in ((0, 100), (1, 100), (2, 97)):  # balanced's violations 0%, 0%, 3%: the t interval dips below 0
        for policy, good in (("full", 50), ("balanced", bal)):
            store.mark(put(tmp_path, "conv", 256, policy, seed, 0.125, 100, good), overload_of_full=1.25)
    s = overload.summary(overload.pairs(tmp_path, "conv", 256, None)[(1.25, "balanced")])
    assert s["violations_other"].lo == 0.0 and s["violations_other"].mean == pytest.approx(0.01)
    assert s["cut"].hi == 1.0 and 0 < s["cut"].lo < 1
