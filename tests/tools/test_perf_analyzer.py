"""tools/perf_analyzer.py: a level whose profile export comes back empty is run once more, then named."""

from __future__ import annotations

import json

import pytest

from tools import perf_analyzer as pa


def fake_perf_analyzer(tmp_path, empty_runs: int):
    """A stand-in binary that exits 0 and leaves the export empty on its first `empty_runs` runs, and refuses an
    export path that already exists as perf_analyzer 2.51 does (exit 99, the reason first, then its usage)."""
    count = tmp_path / "runs"
    script = tmp_path / "perf_analyzer"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}\n"
        'out=""; while [ $# -gt 0 ]; do [ "$1" = --profile-export-file ] && out="$2"; shift; done\n'
        'if [ -e "$out" ]; then echo "Error: Failed to parse --profile-export-file. Path must not already exist."; '
        "yes usage | head -2000; exit 99; fi\n"
        f'if [ "$n" -le {empty_runs} ]; then : > "$out"; else echo \'{{"ok": 1}}\' > "$out"; fi\n'
    )
    script.chmod(0o755)
    return script, count


def run_level(tmp_path, script):
    profile = tmp_path / "profile_export_c4.json"
    cmd = [str(script), "--profile-export-file", str(profile)]
    return pa._run_level(cmd, {}, 4, profile, tmp_path, timeout_s=30)


def test_an_empty_export_is_run_again_once(tmp_path, capsys):
    script, count = fake_perf_analyzer(tmp_path, empty_runs=1)
    assert run_level(tmp_path, script) == {"ok": 1}
    assert count.read_text().strip() == "2"
    assert "running the level again" in capsys.readouterr().out


def test_an_export_empty_twice_is_an_error_naming_it(tmp_path):
    script, count = fake_perf_analyzer(tmp_path, empty_runs=2)
    with pytest.raises(RuntimeError, match="concurrency 4 but its profile export .* is unreadable .*twice"):
        run_level(tmp_path, script)
    assert count.read_text().strip() == "2"


def test_a_failure_names_perf_analyzers_own_reason(tmp_path):
    script, _ = fake_perf_analyzer(tmp_path, empty_runs=0)
    (tmp_path / "profile_export_c4.json").write_text("{}")  # left by an earlier run
    with pytest.raises(RuntimeError, match="(?s)failed \\(99\\) at concurrency 4.*Path must not already exist"):
        run_level(tmp_path, script)


def test_a_good_export_runs_once(tmp_path):
    script, count = fake_perf_analyzer(tmp_path, empty_runs=0)
    assert run_level(tmp_path, script) == json.loads('{"ok": 1}')
    assert count.read_text().strip() == "1"
