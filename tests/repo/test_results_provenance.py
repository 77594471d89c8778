"""Every committed report names the commit of the code that produced it, and that commit is in the history.

Needs the repository's git history (CI runs on a full clone of main). In a checkout without it (no .git, or a
shallow clone that lacks the commit) the test fails and says so instead of passing unchecked."""

import re
import subprocess

import pytest
from tests import ROOT

COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _reports() -> list:
    """Committed (or committable) reports: scratch output under git-ignored folders (results/tmp/) is not one."""
    found = sorted((ROOT / "results").glob("**/report.md"))
    ignored = set(git("check-ignore", *map(str, found)).stdout.split()) if found else set()
    return [p for p in found if str(p) not in ignored]


REPORTS = _reports()


def test_there_are_reports_to_check():
    assert REPORTS, "no results/**/report.md found: the provenance check would check nothing"


@pytest.mark.parametrize("report", REPORTS, ids=[str(p.relative_to(ROOT)) for p in REPORTS])
def test_report_names_a_commit_in_the_history(report):
    named = COMMIT.findall(report.read_text())
    assert named, f"{report.relative_to(ROOT)} names no commit ('commit <sha>') of the code that produced it"
    inside = git("rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        pytest.fail(
            f"no git history here ({inside.stderr.strip() or 'not a work tree'}): cannot check that the "
            f"commits named in {report.relative_to(ROOT)} exist; run the tests in a git clone of the repository"
        )
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    for sha in named:
        found = git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
        assert found, f"{report.relative_to(ROOT)} names commit {sha}, which is not in the history" + (
            " (this is a shallow clone: `git fetch --unshallow` and run again)" if shallow else ""
        )
