"""tools/kernel_builds_ab.py: builds of the kernels compared process by process (tiny: one pair, two steps)."""

from __future__ import annotations

import pytest

from plugins import cpu_kernels
from tests import ROOT
from tools import kernel_builds_ab


def test_fewer_than_two_builds_or_a_missing_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kernel_builds_ab.main(["--lib", str(tmp_path / "a.so")])
    assert "two or more --lib" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernel_builds_ab.main(["--lib", str(tmp_path / "a.so"), "--lib", str(tmp_path / "b.so")])
    assert "no such library" in capsys.readouterr().err


def test_trees_need_two_checkouts_of_the_project_and_one_library(tmp_path, capsys):
    root = str(ROOT)
    for argv, says in [
        (["--tree", root], "two or more --tree"),
        (["--tree", root, "--tree", root, "--lib", "a.so", "--lib", "b.so"], "at most one --lib"),
        (["--tree", root, "--tree", str(tmp_path)], "not a checkout of this project"),
    ]:
        with pytest.raises(SystemExit):
            kernel_builds_ab.main(argv)
        assert says in capsys.readouterr().err


@pytest.mark.needs_model  # its engines load the real fragment set
@pytest.mark.skipif(not cpu_kernels.library_path().is_file(), reason="the C++ kernels are not built: run make setup")
def test_each_build_runs_in_its_own_process_and_the_ratio_comes_with_its_range(tmp_path):
    lib = str(cpu_kernels.library_path())
    copy = tmp_path / "copy.so"
    copy.write_bytes(cpu_kernels.library_path().read_bytes())
    out = kernel_builds_ab.run_pairs(
        [lib, str(copy)], ["int4"], context=40, batch=2, steps=2, pairs=1, weight_dtype="float16"
    )
    assert [r["lib"] for r in out["runs"]] == [lib, str(copy)]
    assert all(r["step_s"]["int4"] > 0 and r["bandwidth_GBps"] > 0 for r in out["runs"])
    r = out["first_over_other"]["copy.so int4"]
    assert r["low"] <= r["median"] <= r["high"]


@pytest.mark.needs_model
@pytest.mark.skipif(not cpu_kernels.library_path().is_file(), reason="the C++ kernels are not built: run make setup")
def test_checkouts_run_in_their_own_processes_on_one_library():
    root = str(ROOT)
    out = kernel_builds_ab.run_pairs(
        [str(cpu_kernels.library_path())],
        ["full"],
        context=40,
        batch=1,
        steps=2,
        pairs=1,
        weight_dtype="float16",
        trees=[root, root],
    )
    label = kernel_builds_ab.tree_label(root)
    assert "@" in label and not label.endswith("@?")
    assert [r["side"] for r in out["runs"]] == [label, label]
    assert all(r["step_s"]["full"] > 0 for r in out["runs"])


def test_a_library_path_is_written_without_the_machine_s_folders(tmp_path):
    assert kernel_builds_ab.portable_path(str(ROOT / "build" / "kernels" / "x.so")) == "build/kernels/x.so"
    assert kernel_builds_ab.portable_path(str(tmp_path / "before.so")) == "before.so"
