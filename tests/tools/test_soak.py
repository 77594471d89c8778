"""tools/soak.py, the 60-second version (make soak runs 10 minutes): open-loop traffic at 1.5x the measured
capacity with bad requests and cancellations; nothing lost, no invariant violation, no leak."""

import json

import numpy as np
import pytest

from tools import soak

pytestmark = [pytest.mark.needs_model, pytest.mark.server, pytest.mark.soak]


def test_a_one_minute_soak_loses_nothing_and_leaks_nothing(tmp_path):
    code = soak.main(["--minutes", "1", "--calibrate-s", "10", "--warmup-s", "15", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    q = report["requests"]
    print(f"[soak] {q} RSS growth {report['rss_growth_after_warmup']:+.2%} checks {report['checks']}")
    assert q["lost"] == 0 and q["unaccounted"] == 0 and not q["unexpected_errors"]
    assert q["completed"] > 0 and q["errored"] > 0 and q["cancelled"] > 0  # every kind was sent
    assert report["after"]["invariant_violations"] == 0
    assert code == 0, report["checks"]
    assert (tmp_path / "soak_rss.png").stat().st_size > 0 and "| sent |" in (tmp_path / "soak.md").read_text()


def test_rss_slope_finds_a_leak_and_passes_a_flat_line():
    rng = np.random.default_rng(0)
    t = np.arange(0, 40 * 60, 1.0)
    noise = rng.normal(0, 2**20, t.size)  # RSS moving a MiB either way with every burst
    flat = soak.rss_slope(list(zip(t, 300 * 2**20 + noise)), warmup_s=300)
    leak = soak.rss_slope(list(zip(t, 300 * 2**20 + noise + 0.5 * 2**20 * t / 60)), warmup_s=300)
    assert flat["ci95"][0] < 0 < flat["ci95"][1] and abs(flat["mib_per_min"]) < 0.05
    assert 0.45 < leak["ci95"][0] < 0.5 < leak["ci95"][1] < 0.55
    assert flat["minutes"] == 35
    assert soak.rss_slope(list(zip(t[:300], noise[:300])), warmup_s=60) is None  # 4 minutes: too few to judge


def test_the_leak_check_compares_rss_in_the_same_morph_state():
    # Flat at rest, then a morph episode near the end holds 80 MiB more (what the hour soak showed): the slope
    # over every sample reads it as growth, the slope at rest does not.
    t = np.arange(0, 60 * 60, 1.0)
    episode = (t > 3200) & (t < 3500)
    rss = 514 * 2**20 + np.where(episode, 80 * 2**20, 0)
    states = [(x, (4, 0, 300) if e else (0, 0, 200)) for x, e in zip(t, episode)]
    samples = list(zip(t, rss))
    rest_samples, rest = soak.at_rest(samples, states, warmup_s=720)
    assert rest == (0, 0, 200) and len(rest_samples) == len(t) - episode.sum()
    assert soak.rss_slope(samples, 720)["ci95"][0] > 0.1
    assert abs(soak.rss_slope(rest_samples, 720)["mib_per_min"]) < 1e-9
    assert soak.at_rest(samples, [(x, (None,)) for x in t], 720) == (samples, None)  # metrics never answered
