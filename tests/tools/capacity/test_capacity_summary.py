"""Gathering capacity runs into results/replay/capacity.json (tools/capacity/summary.py): cells grouped by
traffic and pool across runs, pooled only where two runs measured the policy, SLO mismatches refused."""

import json

from tools.capacity import summary
from tests.tools.capacity.test_capacity_pooled import _run


def _slo(path, ttft=2.0):
    data = json.loads(path.read_text())
    data["slo"] = {"ttft_s": ttft, "tpot_s": 0.35, "target_attainment": 0.9}
    path.write_text(json.dumps(data))
    return path.parent


def test_cells_gather_runs_and_pool_where_two_runs_measured_the_policy(tmp_path):
    a = _slo(_run(tmp_path, "a", {0: 0.1, 1: 0.12}, {0: 0.2, 1: 0.25}))
    b = _slo(_run(tmp_path, "b", {2: 0.15, 3: 0.14}, {2: 0.3, 3: 0.27}))
    c = _slo(_run(tmp_path, "c", {0: 0.5}, {0: 0.5}, pool=1024))
    out = summary.summarize([a, b, c])
    assert out["slo"]["ttft_s"] == 2.0
    cells = {(x["traffic"], x["pool_tokens"]): x for x in out["cells"]}
    assert set(cells) == {("conv", 256), ("conv", 1024)}
    c256 = cells[("conv", 256)]
    assert [r["run"] for r in c256["runs"]] == ["a", "b"] and c256["latest"] == "b"
    per_run = c256["pooled"]["balanced"]["ratio_per_run"]
    assert per_run["n"] == 2 and abs(per_run["mean"] - ((0.45 / 0.22) + (0.57 / 0.29)) / 2) < 1e-9
    assert c256["pooled"]["balanced"]["ratio_per_seed"]["n"] == 4
    assert cells[("conv", 1024)]["pooled"] == {}  # one run: its own figures are the reading
    newest, pooled = summary.newest_ratios(out), summary.pooled_ratios(out)
    assert abs(newest[("conv", 256)]["balanced"].mean - 0.57 / 0.29) < 1e-9  # b's own figure
    assert pooled[("conv", 256)]["balanced"].n == 2  # the pooled per-run reading: one per run
    assert newest[("conv", 1024)]["balanced"].mean == 1.0 and pooled[("conv", 1024)] == {}


def test_runs_under_different_slos_or_without_a_json_are_refused(tmp_path, capsys):
    a = _slo(_run(tmp_path, "a", {0: 0.1}, {0: 0.2}))
    b = _slo(_run(tmp_path, "b", {0: 0.1}, {0: 0.2}), ttft=1.0)
    assert summary.main([str(a), str(b), "--json", str(tmp_path / "s.json")]) == 2
    assert "different SLOs" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert summary.main([str(a), str(tmp_path / "empty"), "--json", str(tmp_path / "s.json")]) == 2
    assert "no capacity.json" in capsys.readouterr().err
    assert summary.main([str(a), "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "map.png")]) == 0
    assert (tmp_path / "map.png").stat().st_size > 0
    written = json.loads((tmp_path / "s.json").read_text())
    assert written["command"].startswith("python -m tools.capacity.summary") and written["cells"][0]["latest"] == "a"


def test_a_runs_overload_figures_are_carried_into_its_cell(tmp_path):
    path = _run(tmp_path, "a", {0: 0.1}, {0: 0.2})
    data = json.loads(path.read_text())
    data["cells"][0]["overload"] = {"1.25": {"balanced": {"cut": {"mean": 0.97, "ci95": [0.95, 0.99], "n": 3}}}}
    path.write_text(json.dumps(data))
    b = _slo(_run(tmp_path, "b", {0: 0.1}, {0: 0.2}))
    runs = summary.summarize([_slo(path), b])["cells"][0]["runs"]
    assert runs[0]["overload"]["1.25"]["balanced"]["cut"]["mean"] == 0.97 and "overload" not in runs[1]


def test_the_map_draws_lines_where_a_kind_has_them_and_every_point_of_a_kind_that_has_none():
    ratios = {
        ("conv", 256): {"balanced": "b256", "int4": "i256"},
        ("conv", 1024): {"balanced": "b1024"},
        ("code", 256): {"balanced": "c256"},
        ("code", 2048): {"performance": "c2048"},
        ("conv-thin0.0375", 256): {"balanced": "t256"},
    }
    m = summary.mapped(ratios)
    assert m[("conv", 256)] == {"balanced": "b256"}  # int4 at one pool only, where conv has a line: left out
    assert m[("conv", 1024)] == {"balanced": "b1024"}
    assert m[("code", 256)] == {"balanced": "c256"} and m[("code", 2048)] == {"performance": "c2048"}
    assert ("conv-thin0.0375", 256) not in m  # a thinned variant stays in its run's report


def test_equal_memory_cells_come_first_and_carry_their_budget(tmp_path):
    old = _slo(_run(tmp_path, "old", {0: 0.1}, {0: 0.3}, pool=256))
    new = _run(tmp_path, "new", {0: 0.1}, {0: 0.2}, pool=512)
    data = json.loads(new.read_text())
    data["cells"][0]["memory_budget_bytes"] = 280_000_000
    new.write_text(json.dumps(data))
    out = summary.summarize([old, _slo(new)])
    assert [(c["pool_tokens"], c["equal_memory"]) for c in out["cells"]] == [(512, True), (256, False)]
    assert out["cells"][0]["runs"][0]["memory_budget_bytes"] == 280_000_000
    assert "memory_budget_bytes" not in out["cells"][1]["runs"][0]
    assert (
        summary.main([str(old), str(_slo(new)), "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "m.png")])
        == 0
    )
