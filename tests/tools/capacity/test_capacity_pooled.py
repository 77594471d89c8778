"""Pooling capacity runs (tools/capacity/pooled.py): per-seed and per-run intervals by hand, runs that did not
measure the cell are skipped, and the CLI names a missing file."""

import json
import math

import pytest

from tools.capacity import pooled
from tools.capacity.stats import t_quantile


def _policy(per_seed: dict[int, float], ratio: float | None, failed: bool = True) -> dict:
    vals = list(per_seed.values())
    m = sum(vals) / len(vals)
    iv = {"mean": m, "ci95": [None, None], "n": len(vals)}
    return {
        "capacity_rate_scale": iv,
        "ratio_to_full": {"mean": ratio, "ci95": [None, None], "n": len(vals)} if ratio is not None else None,
        "per_seed": [
            {"seed": s, "capacity_rate_scale": c, "failed_above": c * 1.05 if failed else None}
            for s, c in per_seed.items()
        ],
    }


def _run(tmp_path, name: str, full: dict, balanced: dict, *, traffic="conv", pool=256, failed=True):
    folder = tmp_path / name
    folder.mkdir()
    ratio = sum(balanced.values()) / sum(full.values())
    cell = {
        "traffic": traffic,
        "pool_tokens": pool,
        "policies": {"full": _policy(full, 1.0), "balanced": _policy(balanced, ratio, failed)},
    }
    path = folder / "capacity.json"
    path.write_text(json.dumps({"commits": [name], "cells": [cell]}))
    return path


def test_per_seed_and_per_run_intervals_by_hand(tmp_path):
    a = _run(tmp_path, "a", {0: 0.2, 1: 0.25}, {0: 0.4, 1: 0.5})  # ratios 2.0, 2.0; run ratio 2.0
    b = _run(tmp_path, "b", {3: 0.1, 4: 0.2}, {3: 0.3, 4: 0.2})  # ratios 3.0, 1.0; run ratio 5/3
    runs = [pooled.read_run(p, "conv", 256, "balanced") for p in (a, b)]
    p = pooled.pool(runs)
    assert p.per_seed.n == 4 and p.per_seed.mean == pytest.approx(2.0)
    sd = math.sqrt((0 + 0 + 1 + 1) / 3)
    assert p.per_seed.lo == pytest.approx(2.0 - t_quantile(0.975, 3) * sd / 2)
    assert p.per_run.n == 2 and p.per_run.mean == pytest.approx((2.0 + 5 / 3) / 2)
    assert runs[0].run == "a" and all(s.bracketed for s in runs[0].seeds)


def test_target_needs_both_the_mean_and_the_lower_end(tmp_path):
    paths = [_run(tmp_path, f"r{i}", {0: 0.2, 1: 0.2}, {0: 0.4, 1: 0.42}) for i in range(3)]
    p = pooled.pool([pooled.read_run(x, "conv", 256, "balanced") for x in paths])
    assert p.meets_target(p.per_seed) and p.meets_target(p.per_run)
    wide = pooled.pool(
        [pooled.read_run(_run(tmp_path, "w", {0: 0.2, 1: 0.2}, {0: 0.2, 1: 0.6}), "conv", 256, "balanced")]
    )
    assert wide.per_seed.mean == pytest.approx(2.0) and not wide.meets_target(wide.per_seed)


def test_runs_without_the_cell_are_skipped_and_unbracketed_seeds_marked(tmp_path):
    other = _run(tmp_path, "other", {0: 0.2}, {0: 0.3}, pool=1024)
    assert pooled.read_run(other, "conv", 256, "balanced") is None
    assert pooled.read_run(other, "conv", 1024, "accuracy") is None
    bound = pooled.read_run(_run(tmp_path, "bound", {0: 0.2}, {0: 0.5}, failed=False), "conv", 256, "balanced")
    assert not bound.seeds[0].bracketed
    assert "(bound)" in pooled.render(pooled.pool([bound]), "conv", 256, "balanced")
    with pytest.raises(ValueError, match="no run measured"):
        pooled.pool([])


def test_cli_writes_markdown_and_names_a_missing_file(tmp_path, capsys):
    a = _run(tmp_path, "a", {0: 0.2, 1: 0.25}, {0: 0.4, 1: 0.5})
    out = tmp_path / "pooled.md"
    assert pooled.main([str(a), "--out", str(out)]) == 0
    assert "over 1 run" in out.read_text() and "Per run" in capsys.readouterr().out
    assert pooled.main([str(a), "--pool", "4096"]) == 2
    with pytest.raises(SystemExit):
        pooled.main([str(tmp_path / "nope.json")])
    assert "no such capacity.json" in capsys.readouterr().err
