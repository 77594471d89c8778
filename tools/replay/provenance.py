"""Which code produced a run: the commit checked out when it ran (and whether tracked files differed from it),
recorded with the raw results so that a report rebuilt later still names the run's commit, not the rebuild's."""

from __future__ import annotations

import subprocess
import time

from tools.replay.paths import REPO_ROOT


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_version() -> dict:
    """{"commit": full sha or None (no git), "dirty": tracked files changed since it}, at run time."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def describe(run: dict) -> str:
    """'2026-11-29 20:48 UTC, commit 699afc3' from a run.json / sweep.json, saying so when something is missing."""
    return f"{run.get('finished') or 'time not recorded'}, {commit_phrase(run)}"


def commit_phrase(run: dict) -> str:
    """'commit 699afc3' (plus whether tracked files differed) from a run's recorded code_version()."""
    commit = run.get("commit")
    if not commit:
        return "commit not recorded"
    return f"commit {commit[:7]}" + (" with uncommitted changes to tracked files" if run.get("dirty") else "")
