"""The layering contracts of pyproject.toml ([tool.importlinter]), checked with import-linter: on the project,
and on a throwaway tree that breaks each of them (so a contract that checks nothing would show)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests import ROOT

LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--config", "pyproject.toml", "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_project_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(contracts())} kept, 0 broken" in r.stdout


def test_each_contract_catches_its_violation(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    modules = {m for c in contracts() for key in ("source_modules", "forbidden_modules") for m in c[key]}
    for pkg in ("trtllm_backend", "plugins", "engines", "trtllm_backend/triton"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for mod in modules:
        path = tmp_path.joinpath(*mod.split("."))
        if not path.is_dir():
            path.with_suffix(".py").write_text("")
    (tmp_path / "plugins" / "kernel.py").write_text("from trtllm_backend import kv_cache\n")
    (tmp_path / "trtllm_backend" / "morph.py").write_text("from . import engine\n")
    (tmp_path / "trtllm_backend" / "engine.py").write_text("from .triton import metrics\n")
    (tmp_path / "trtllm_backend" / "triton" / "metrics.py").write_text("")
    r = lint(tmp_path)
    assert r.returncode != 0
    assert f"0 kept, {len(contracts())} broken" in r.stdout, r.stdout + r.stderr
