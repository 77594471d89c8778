"""tools/soak.py, the 60-second version (make soak runs 10 minutes): open-loop traffic at 1.5x the measured
capacity with bad requests and cancellations; nothing lost, no invariant violation, no leak."""
import json

import pytest

from tools import soak

pytestmark = pytest.mark.slow


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
