"""Launcher: start a real tritonserver on a model repository.

    python -m trtllm_backend.serve [--model-repository DIR] [--http-port 8000 --grpc-port 8001
        --metrics-port 8002] [--param NAME=VALUE ...] [--backend-dir build/backends]

Uses /opt/tritonserver (the NGC image) when present, otherwise the tritonserver and Python backend shipped
in the installed nvidia-pytriton wheel (Triton 2.51). Also importable: `launch(...)` returns a
`ServerHandle` with `.stop()` (the test fixture uses it).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import triton_params
from .openmp_env import with_openmp_defaults

PROJECT_ROOT = Path(__file__).resolve().parent.parent
NGC_ROOT = Path("/opt/tritonserver")
SHM_PREFIX = "triton_python_backend_shm_region_"
PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class TritonInstall:
    server: Path  # the tritonserver binary
    backend_dir: Path | None  # a ready backend directory (NGC), or None: we build one from the parts below
    python_backend: Path | None = None  # folder with libtriton_python.so and triton_python_backend_utils.py
    stub: Path | None = None  # triton_python_backend_stub for the running Python


def free_ports(n: int) -> list[int]:
    """n TCP ports free right now (for servers started side by side: tests, benchmarks)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_triton() -> TritonInstall:
    if (NGC_ROOT / "bin" / "tritonserver").exists():
        return TritonInstall(server=NGC_ROOT / "bin" / "tritonserver", backend_dir=NGC_ROOT / "backends")
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("no tritonserver: install nvidia-pytriton==0.7.0 (or run in the NGC image)") from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(server=root / "bin" / "tritonserver", backend_dir=None,
                            python_backend=root / "backends" / "python",
                            stub=root / "python_backend_stubs" / pyver / "triton_python_backend_stub")
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
    for src in (install.python_backend / "libtriton_python.so",
                install.python_backend / "triton_python_backend_utils.py", install.stub):
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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return with_openmp_defaults(env)


# --- config.pbtxt parameters ------------------------------------------------------------------------------
_PARAM_RE = re.compile(
    r'parameters\s*:?\s*\{\s*key\s*:\s*"(?P<key>[^"]+)"\s*'
    r'value\s*:?\s*\{\s*string_value\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*\}\s*\}')


def read_parameters(pbtxt: str) -> dict[str, str]:
    return {m["key"]: _unescape(m["value"]) for m in _PARAM_RE.finditer(pbtxt)}


def set_parameters(pbtxt: str, updates: dict[str, str]) -> str:
    """Replace the value of each existing key, append the others as new `parameters` entries."""
    pending = dict(updates)

    def edit(m: re.Match) -> str:
        if m["key"] not in pending:
            return m.group(0)
        start, end = m.span("value")
        text = m.group(0)
        offset = m.start()
        return text[: start - offset] + _escape(pending.pop(m["key"])) + text[end - offset:]

    out = _PARAM_RE.sub(edit, pbtxt)
    for key, value in pending.items():
        out += f'\nparameters: {{\n  key: "{key}"\n  value: {{ string_value: "{_escape(value)}" }}\n}}\n'
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def apply_overrides(repo: Path, model: str, overrides: dict[str, str], dest: Path) -> Path:
    """A copy of `repo` under `dest` where `model`'s config.pbtxt carries the overrides. Everything else is a
    symlink (fragments are large), so relative paths in the model resolve to the original folder."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in repo.iterdir():
        if entry.name != model:
            (dest / entry.name).symlink_to(entry.resolve())
    (dest / model).mkdir()
    for entry in (repo / model).iterdir():
        if entry.name != "config.pbtxt":
            (dest / model / entry.name).symlink_to(entry.resolve())
    text = (repo / model / "config.pbtxt").read_text()
    (dest / model / "config.pbtxt").write_text(set_parameters(text, overrides))
    return dest


def model_parameters(repo: Path, model: str, overrides: dict[str, str]) -> triton_params.ParsedParams:
    """Validate the file's parameters plus the overrides exactly as the model will at load."""
    raw = read_parameters((repo / model / "config.pbtxt").read_text())
    raw.update(overrides)
    return triton_params.parse_params(raw, base_dir=str(repo / model / "1"))


def ensure_fragments(parsed: triton_params.ParsedParams) -> None:
    frag = Path(parsed.engine["fragment_dir"])
    if (frag / "manifest.json").exists():
        return
    print(f"[serve] no fragments in {frag}: building them (engines.build_fragments --if-missing)", flush=True)
    subprocess.run([sys.executable, "-m", "engines.build_fragments", "--if-missing"], cwd=PROJECT_ROOT,
                   env=server_env(), check=True)


# --- the running server --------------------------------------------------------------------------------------
@dataclass(slots=True)
class ServerHandle:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    model: str
    shm_prefix: str  # the Python backend's shared-memory regions are /dev/shm/<shm_prefix>*
    log_path: Path | None = None
    repo_copy: Path | None = None  # the edited copy of the repository (--param), removed on stop
    exit_timeout_s: int = 30
    stub_died: bool = False  # set by the watcher when a Python backend stub exited under a running server
    stopping: bool = False  # stop() was called: stubs exiting now is the normal unload
    _log_file: object = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM (Triton unloads models: finalize drains), then SIGKILL after `timeout` (default: the exit
        timeout plus a margin: with a request stuck in a dead stub tritonserver never exits by itself)."""
        self.stopping = True
        with self._lock:
            if self.alive():
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(self.exit_timeout_s + 5 if timeout is None else timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            # NOTE: a killed (or crashed) tritonserver leaves its Python stubs running, each holding the
            # model; they share the server's process group (start_new_session), so end what is left of it.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            self.clean_shm()
            if self.repo_copy is not None:
                shutil.rmtree(self.repo_copy, ignore_errors=True)
            return self.process.returncode

    def stub_pids(self) -> list[int]:
        """The server's children: the Python backend stubs, one per model instance."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                after_name = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(after_name[1]) == self.process.pid and after_name[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def watch_stubs(self, interval: float = 1.0) -> threading.Thread:
        """A stub that dies leaves Triton "ready" but answering every request with an error, and a request
        in flight never ends: stop the whole server instead, so a supervisor (or the caller) can restart it."""
        expected = len(self.stub_pids())

        def watch():
            while self.alive() and not self.stopping and len(self.stub_pids()) >= expected:
                time.sleep(interval)
            if self.alive() and not self.stopping:
                self.stub_died = True
                print("[serve] a Python backend stub exited: stopping tritonserver", file=sys.stderr, flush=True)
                self.stop()

        thread = threading.Thread(target=watch, name="stub-watch", daemon=True)
        thread.start()
        return thread

    def clean_shm(self) -> list[Path]:
        """Remove this server's leaked shared-memory regions (a crashed stub leaves them behind)."""
        leaked = sorted(Path("/dev/shm").glob(self.shm_prefix + "*"))
        for path in leaked:
            path.unlink(missing_ok=True)
        return leaked

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(model_repository: str | Path = "model_repository", *, model: str = "smollm2", http_port: int = 8000,
           grpc_port: int = 8001, metrics_port: int = 8002, params: dict[str, str] | None = None,
           backend_dir: str | Path = "build/backends", build_dir: str | Path = "build",
           build_fragments: bool = True, log_path: str | Path | None = None, ready_timeout: float = 300.0,
           exit_timeout_s: int = 30, extra_args: list[str] | None = None, check_params: bool = True) -> ServerHandle:
    """Start tritonserver and return once /v2/health/ready answers 200 (every model loaded).
    check_params=False skips the launcher's own check, so the model's load-time check is what refuses."""
    repo = _rooted(model_repository).resolve()
    if not (repo / model / "config.pbtxt").exists():
        raise FileNotFoundError(f"{repo / model / 'config.pbtxt'} not found")
    overrides = dict(params or {})
    if check_params:
        parsed = model_parameters(repo, model, overrides)  # fails here, before any server starts
        if build_fragments:
            ensure_fragments(parsed)
    repo_copy = None
    if overrides:
        repo = repo_copy = apply_overrides(repo, model, overrides,
                                           _rooted(build_dir) / f"model_repository.{uuid.uuid4().hex[:8]}")
    install = find_triton()
    backends = prepare_backend_dir(install, _rooted(backend_dir))
    # NOTE: a prefix of our own, so cleaning leaked regions never touches another server's.
    shm_prefix = f"{SHM_PREFIX}{uuid.uuid4().hex[:8]}_"
    cmd = [str(install.server), f"--model-repository={repo}", f"--backend-directory={backends}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
           "--allow-metrics=true", f"--exit-timeout-secs={exit_timeout_s}",
           f"--backend-config=python,shm-region-prefix-name={shm_prefix}", *(extra_args or [])]
    log_file = open(log_path, "w") if log_path else None
    process = subprocess.Popen(cmd, env=server_env(), stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                               start_new_session=True, preexec_fn=_die_with_parent)
    handle = ServerHandle(process, http_port, grpc_port, metrics_port, model, shm_prefix,
                          Path(log_path) if log_path else None, repo_copy, exit_timeout_s, _log_file=log_file)
    try:
        _wait_ready(handle, ready_timeout)
    except BaseException:
        handle.stop(timeout=10)
        raise
    handle.watch_stubs()
    return handle


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launching thread dies, so a killed launcher or test run
    never leaves a server (and its model-holding stubs) behind. NOTE: call launch() from a long-lived thread."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux/glibc: the server simply outlives a killed launcher
        pass


def _wait_ready(handle: ServerHandle, timeout: float) -> None:
    url = f"http://localhost:{handle.http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"tritonserver exited with code {handle.process.returncode} before it was ready"
                               + (f"; last log lines:\n{handle.log_tail()}" if handle.log_path else ""))
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s")


def _rooted(path: str | Path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else Path.cwd() / path


def _print_endpoints(handle: ServerHandle) -> None:
    m = handle.model
    print(f"""
[serve] ready: model '{m}'
  HTTP     http://localhost:{handle.http_port}   (/v2/models/{m}/generate, SSE: /v2/models/{m}/generate_stream)
  gRPC     localhost:{handle.grpc_port}
  metrics  {handle.metrics_url}
  try:
    curl -s -X POST localhost:{handle.http_port}/v2/models/{m}/generate \\
      -d '{{"text_input": "The capital of France is", "max_tokens": 16}}'
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_backend.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--model", default="smollm2", help="the model that --param applies to")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="override a config.pbtxt parameter for this run (repeatable); see the README")
    ap.add_argument("--backend-dir", default="build/backends")
    ap.add_argument("--no-build-fragments", action="store_true")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    args = ap.parse_args(argv)
    try:
        overrides = dict(triton_params.parse_assignment(a) for a in args.param)
        handle = launch(args.model_repository, model=args.model, http_port=args.http_port,
                        grpc_port=args.grpc_port, metrics_port=args.metrics_port, params=overrides,
                        backend_dir=args.backend_dir, build_fragments=not args.no_build_fragments,
                        ready_timeout=args.ready_timeout, extra_args=args.server_arg)
    except (triton_params.ParamError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"[serve] error: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the server drains on SIGTERM; Ctrl-C means the same
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _print_endpoints(handle)
    while handle.alive() and not stop.wait(0.5):
        pass
    code = handle.stop()
    return 1 if handle.stub_died else code


if __name__ == "__main__":
    sys.exit(main())
