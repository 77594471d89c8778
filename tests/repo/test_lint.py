"""The lint and format rules of pyproject.toml ([tool.ruff]): the project passes them, and a file that breaks
them fails (so a configuration that checks nothing would show)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

RUFF = Path(sys.executable).with_name("ruff")


def ruff(*args: str, cwd: Path = ROOT, command: str = "check") -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.skip(f"ruff is not installed beside {sys.executable} (pip install -e '.[test]')")
    return subprocess.run(
        [str(RUFF), command, "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_project_passes_the_lint_rules():
    r = ruff(".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_undefined_name_and_an_unused_import_fail(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    r = ruff(".", cwd=tmp_path)
    assert r.returncode == 1
    assert "F401" in r.stdout and "F821" in r.stdout, r.stdout


def test_the_project_is_formatted():
    r = ruff("--check", ".", command="format")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr


def test_an_unformatted_file_fails_the_format_check(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "ugly.py").write_text("x = {  'a':1 }\n")
    r = ruff("--check", ".", cwd=tmp_path, command="format")
    assert r.returncode == 1 and "ugly.py" in r.stdout, r.stdout
