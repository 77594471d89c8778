"""tools.replay.provenance: a run records the commit checked out when it ran, and the report line says what is
known and what is not."""

import subprocess

from tools.replay.paths import REPO_ROOT
from tools.replay.provenance import code_version, describe


def test_code_version_is_the_checked_out_commit():
    def head():
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()

    before, v, after = head(), code_version(), head()  # others may commit meanwhile in a shared checkout
    assert v["commit"] in (before, after) and len(v["commit"]) == 40
    assert isinstance(v["dirty"], bool)


def test_describe():
    sha = "699afc3aa9376b3e4867f926924fd67009ecf050"
    assert (
        describe({"commit": sha, "dirty": False, "finished": "2026-11-29 20:48 UTC"})
        == "2026-11-29 20:48 UTC, commit 699afc3"
    )
    assert (
        describe({"commit": sha, "dirty": True, "finished": "t"})
        == "t, commit 699afc3 with uncommitted changes to tracked files"
    )
    assert describe({"command": "x"}) == "time not recorded, commit not recorded"
