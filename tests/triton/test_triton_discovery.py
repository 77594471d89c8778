"""trtllm_backend.triton.discovery: the installed tritonserver, the backend folder of symlinks, the server's
environment (which must import the project through the install alone: model.py adds no path)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests import ROOT
from trtllm_backend.triton.discovery import (
    TritonInstall,
    find_triton,
    prepare_backend_dir,
    pytriton_install,
    server_env,
)


def test_the_installed_server_is_found():
    install = find_triton()
    assert install.server.is_file() and install.server.name == "tritonserver"
    if install.backend_dir is None:  # nvidia-pytriton: the parts the launcher links together
        assert (install.python_backend / "libtriton_python.so").is_file() and install.stub.is_file()


def test_an_incomplete_pytriton_names_the_missing_part(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").touch()
    with pytest.raises(RuntimeError, match=r"incomplete: .*backends/python is missing"):
        pytriton_install(tmp_path)


def _fake_parts(tmp_path: Path) -> TritonInstall:
    backend = tmp_path / "src" / "backends" / "python"
    backend.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        (backend / name).write_text(name)
    return TritonInstall(
        server=tmp_path / "tritonserver",
        backend_dir=None,
        python_backend=backend,
        stub=backend / "triton_python_backend_stub",
    )


def test_backend_dir_links_the_parts_and_replaces_stale_entries(tmp_path):
    install = _fake_parts(tmp_path)
    dest = tmp_path / "backends"
    (dest / "python").mkdir(parents=True)
    (dest / "python" / "libtriton_python.so").write_text("a stale copy")
    assert prepare_backend_dir(install, dest) == dest.resolve()
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        link = dest / "python" / name
        assert link.is_symlink() and link.resolve() == (install.python_backend / name).resolve()
    assert prepare_backend_dir(install, dest) == dest.resolve()  # a second run keeps the same links


def test_a_ready_backend_dir_is_used_as_it_is(tmp_path):
    ngc = TritonInstall(server=tmp_path / "tritonserver", backend_dir=tmp_path / "backends")
    assert prepare_backend_dir(ngc, tmp_path / "unused") == tmp_path / "backends"
    assert not (tmp_path / "unused").exists()


def test_server_env_points_the_stub_at_this_interpreter():
    env = server_env({"PATH": "/bin", "LD_LIBRARY_PATH": "/x"})
    assert env["PATH"].split(":")[:2] == [str(Path(sys.executable).parent), "/bin"]
    assert env["LD_LIBRARY_PATH"].split(":")[-1] == "/x"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == (sysconfig.get_config_var("LIBDIR") or "/x")
    assert "PYTHONPATH" not in env  # the install makes the project importable, not a path


def test_the_server_environment_imports_the_project_from_anywhere(tmp_path):
    """What the stub relies on: the environment, not the working folder or PYTHONPATH, provides the package."""
    env = server_env({"PATH": "/usr/bin:/bin"})
    out = subprocess.run(
        [sys.executable, "-c", "import trtllm_backend.triton.params, plugins, engines; print(trtllm_backend.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent.parent == ROOT
