"""Finding a tritonserver with a Python backend, and the environment its Python stub needs.

/opt/tritonserver (the NGC image) when present, otherwise the server and Python backend shipped in the
installed nvidia-pytriton wheel (Triton 2.51). The stub imports the project from the environment it runs in:
the venv's editable install locally, a `.pth` file in the Docker images (no path is added here).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..openmp_env import with_openmp_defaults

PROJECT_ROOT = Path(__file__).resolve().parents[2]
NGC_ROOT = Path("/opt/tritonserver")


@dataclass(slots=True)
class TritonInstall:
    server: Path  # the tritonserver binary
    backend_dir: Path | None  # a ready backend directory (NGC), or None: we build one from the parts below
    python_backend: Path | None = None  # folder with libtriton_python.so and triton_python_backend_utils.py
    stub: Path | None = None  # triton_python_backend_stub for the running Python


def find_triton() -> TritonInstall:
    if (NGC_ROOT / "bin" / "tritonserver").exists():
        return TritonInstall(server=NGC_ROOT / "bin" / "tritonserver", backend_dir=NGC_ROOT / "backends")
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("no tritonserver: install nvidia-pytriton==0.7.0 (or run in the NGC image)") from exc
    return pytriton_install(Path(pytriton.__file__).resolve().parent / "tritonserver")


def pytriton_install(root: Path) -> TritonInstall:
    """The parts of the server vendored in nvidia-pytriton under `root`; a missing one is named."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        server=root / "bin" / "tritonserver",
        backend_dir=None,
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / pyver / "triton_python_backend_stub",
    )
    for path in (install.server, install.python_backend, install.stub):
        if not path.exists():
            raise RuntimeError(f"nvidia-pytriton install is incomplete: {path} is missing")
    return install


def prepare_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """A backend directory whose python/ holds *symlinks* (a copied stub loses its RPATH to the vendored
    libcudart; a stub in the model folder is not found by 2.51)."""
    if install.backend_dir is not None:
        return install.backend_dir
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (
        install.python_backend / "libtriton_python.so",
        install.python_backend / "triton_python_backend_utils.py",
        install.stub,
    ):
        link = py / src.name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and link.resolve() == src.resolve():
                continue
            link.unlink()
        link.symlink_to(src)
    return dest.resolve()


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The stub embeds Python and finds its environment through PATH; it must load the libpython of *this*
    interpreter (LD_LIBRARY_PATH = its LIBDIR), or it mixes two builds of the same version."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return with_openmp_defaults(env)
