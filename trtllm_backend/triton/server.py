"""One running tritonserver: `launch()` starts it on a model repository and returns a `ServerHandle`.

The handle stops it (asks the stubs to drain and SIGTERMs it, then SIGKILL), ends its Python backend stubs with
it, removes the shared memory they leaked and the edited repository copy, and watches the stubs: a dead stub
stops the whole server. Triton's administrative APIs (shared memory, model repository, logging, trace) are closed
behind a key by default (admin.py); the handle carries it (`admin_headers`) for callers that use them.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import admin
from . import params as triton_params
from . import shutdown
from .config_pbtxt import apply_overrides, model_parameters
from .discovery import PROJECT_ROOT, find_triton, prepare_backend_dir, server_env

SHM_PREFIX = "triton_python_backend_shm_region_"
PR_SET_PDEATHSIG = 1


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


def ensure_fragments(parsed: triton_params.ParsedParams) -> None:
    frag = Path(parsed.engine["fragment_dir"])
    if (frag / "manifest.json").exists():
        return
    print(f"[serve] no fragments in {frag}: building them (engines.build_fragments --if-missing)", flush=True)
    subprocess.run(
        [sys.executable, "-m", "engines.build_fragments", "--if-missing"],
        cwd=PROJECT_ROOT,
        env=server_env(),
        check=True,
    )


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
    control_dir: Path | None = None  # the drain handshake with the stubs (shutdown.py)
    drain_timeout_s: float | None = None  # the model's, when the launcher read its parameters
    drained_but_held: bool = False  # stop() ended a drained server that an open gRPC stream kept from unloading
    stub_died: bool = False  # set by the watcher when a Python backend stub exited under a running server
    stopping: bool = False  # stop() was called: stubs exiting now is the normal unload
    admin_key: str | None = None  # the header value the admin APIs require; None: they are open (admin.py)
    host: str = "localhost"  # where this machine reaches the server (its HTTP/gRPC bind address, when specific)
    _watched_stubs: tuple[tuple[int, ...], int] | None = field(default=None, repr=False)  # (pids, expected)
    _log_file: object = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers that open the admin APIs over HTTP and gRPC alike: pass as `headers=` to tritonclient's calls,
        e.g. `client.load_model(name, headers=handle.admin_headers)`. Empty when they are open."""
        return admin.headers(self.admin_key)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float | None = None) -> int:
        """Ask the stubs to drain and SIGTERM tritonserver (it unloads the model: finalize), then SIGKILL after
        `timeout` (default: drain_timeout_s + 4 s when known, else the exit timeout plus a margin: with a request
        stuck in a dead stub tritonserver never exits by itself). Returns tritonserver's exit status, or 0 when
        every stub drained but an open gRPC stream kept the model from unloading (shutdown.py says why)."""
        if not self.stopping and not self.alive() and self._a_watched_stub_is_gone():
            # the server went down by itself between two of the watcher's polls: classify it here, before the
            # process group is ended below, so the caller never reads stub_died before the watcher woke
            self._note_stub_death(alive=False)
        self.stopping = True
        with self._lock:
            if self.alive():
                if timeout is None:
                    timeout = self.exit_timeout_s + 5 if self.drain_timeout_s is None else self.drain_timeout_s + 4
                stubs = len(self.stub_pids())
                if self.control_dir is not None:
                    shutdown.request_drain(self.control_dir)
                self.process.send_signal(signal.SIGTERM)
                if not self._wait_exit(timeout, stubs):
                    self.drained_but_held = self._held_by_a_stream(stubs)
                    if self.drained_but_held:
                        print(
                            "[serve] every request was answered, but an open gRPC stream keeps Triton from "
                            "unloading the model (Triton 2.51 holds a stream's first request until the client "
                            "closes it): ending tritonserver",
                            file=sys.stderr,
                            flush=True,
                        )
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
            if self.control_dir is not None:
                shutil.rmtree(self.control_dir, ignore_errors=True)
            return 0 if self.drained_but_held else self.process.returncode

    def _wait_exit(self, timeout: float, stubs: int) -> bool:
        """Wait for tritonserver to exit; give up early once the stubs drained and, 2 s later, none finalized."""
        deadline = time.monotonic() + timeout
        drained_at = None
        while time.monotonic() < deadline:
            try:
                self.process.wait(0.1)
                return True
            except subprocess.TimeoutExpired:
                pass
            if drained_at is None and self._held_by_a_stream(stubs, finalized_too=False):
                drained_at = time.monotonic()
            if drained_at is not None and time.monotonic() - drained_at > 2.0 and self._held_by_a_stream(stubs):
                return False
        return False

    def _held_by_a_stream(self, stubs: int, finalized_too: bool = True) -> bool:
        """Every stub drained and (finalized_too) none was finalized: only Triton's hold keeps the server up."""
        if self.control_dir is None or stubs == 0 or shutdown.count(self.control_dir, "drained") < stubs:
            return False
        return not finalized_too or shutdown.count(self.control_dir, "finalizing") == 0

    def stub_pids(self) -> list[int]:
        """The server's children: the Python backend stubs, one per model instance."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            state_and_parent = _state_and_parent(stat)
            if state_and_parent and state_and_parent[1] == self.process.pid and state_and_parent[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def watch_stubs(self, interval: float = 1.0) -> threading.Thread:
        """A stub that dies leaves Triton "ready" but answering every request with an error, and a request
        in flight never ends: stop the whole server instead, so a supervisor (or the caller) can restart it."""
        # NOTE: at least one: a stub killed between "ready" and this line must still count as a death
        started = tuple(self.stub_pids())
        self._watched_stubs = (started, max(1, len(started)))

        def watch():
            while self.alive() and not self.stopping and len(self.stub_pids()) >= self._watched_stubs[1]:
                time.sleep(interval)
            if self.stopping:
                return
            alive = self.alive()
            if alive or self._a_watched_stub_is_gone():
                self._note_stub_death(alive)
            if alive:
                self.stop()

        thread = threading.Thread(target=watch, name="stub-watch", daemon=True)
        thread.start()
        return thread

    def _a_watched_stub_is_gone(self) -> bool:
        """Triton sometimes aborts on its own within the poll interval of a stub's death: a server found dead
        with one of its stubs already gone counts as a stub death too; one that died with its stubs running
        does not."""
        if self._watched_stubs is None:
            return False
        started, expected = self._watched_stubs
        return len(started) < expected or not all(map(_process_running, started))

    def _note_stub_death(self, alive: bool) -> None:
        if self.stub_died:
            return
        self.stub_died = True  # the exit code becomes 1, not Triton's signal
        then = "stopping tritonserver" if alive else "tritonserver went down with it"
        print(f"[serve] a Python backend stub exited: {then}", file=sys.stderr, flush=True)

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


def _state_and_parent(stat: Path) -> tuple[str, int] | None:
    """A /proc/<pid>/stat file's state letter and parent pid; None when the process is gone."""
    try:
        after_name = stat.read_text().rsplit(")", 1)[1].split()
        return after_name[0], int(after_name[1])
    except (OSError, IndexError, ValueError):
        return None


def _process_running(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    state_and_parent = _state_and_parent(Path(f"/proc/{pid}/stat"))
    return state_and_parent is not None and state_and_parent[0] != "Z"


def launch(
    model_repository: str | Path = "model_repository",
    *,
    model: str = "smollm2",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    params: dict[str, str] | None = None,
    backend_dir: str | Path = "build/backends",
    build_dir: str | Path = "build",
    build_fragments: bool = True,
    log_path: str | Path | None = None,
    ready_timeout: float = 300.0,
    exit_timeout_s: int = 30,
    extra_args: list[str] | None = None,
    check_params: bool = True,
    admin_key: str | None = None,
    open_admin: bool | None = None,
    address: str | None = None,
) -> ServerHandle:
    """Start tritonserver and return once /v2/health/ready answers 200 (every model loaded).
    check_params=False skips the launcher's own check, so the model's load-time check is what refuses.
    Admin APIs (admin.RESTRICTED) need the header admin.ADMIN_HEADER with `admin_key` (default:
    $MORPHSERVE_ADMIN_KEY, else a new random key; the handle's admin_key / admin_headers carry it) unless
    `open_admin` (default: $MORPHSERVE_OPEN_ADMIN). `address`: the HTTP and gRPC bind address (and so the
    metrics one, unless extra_args name it); default Triton's, every interface."""
    repo = _rooted(model_repository).resolve()
    if not (repo / model / "config.pbtxt").exists():
        raise FileNotFoundError(f"{repo / model / 'config.pbtxt'} not found")
    overrides = dict(params or {})
    drain_timeout_s = None
    if check_params:
        parsed = model_parameters(repo, model, overrides)  # fails here, before any server starts
        drain_timeout_s = parsed.model.drain_timeout_s
        if build_fragments:
            ensure_fragments(parsed)
    repo_copy = None
    if overrides:
        repo = repo_copy = apply_overrides(
            repo, model, overrides, _rooted(build_dir) / f"model_repository.{uuid.uuid4().hex[:8]}"
        )
    install = find_triton()
    backends = prepare_backend_dir(install, _rooted(backend_dir))
    # NOTE: a prefix of our own, so cleaning leaked regions never touches another server's.
    shm_prefix = f"{SHM_PREFIX}{uuid.uuid4().hex[:8]}_"
    extra_args = list(extra_args or [])
    if open_admin is None:
        open_admin = admin.open_from_env()
    key = None if open_admin else admin.check_key(admin_key or admin.key_from_env() or admin.new_key())
    bind = [f"--http-address={address}", f"--grpc-address={address}"] if address else []
    cmd = [
        str(install.server),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *bind,
        "--allow-metrics=true",
        f"--exit-timeout-secs={exit_timeout_s}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        *(admin.restricted_args(key, extra_args) if key else []),
        *extra_args,
    ]
    log_file = open(log_path, "w") if log_path else None
    control = Path(tempfile.mkdtemp(prefix="morphserve-control-"))
    env = server_env() | {shutdown.CONTROL_DIR_ENV: str(control)}
    process = subprocess.Popen(
        cmd,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT if log_file else None,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    handle = ServerHandle(
        process,
        http_port,
        grpc_port,
        metrics_port,
        model,
        shm_prefix,
        Path(log_path) if log_path else None,
        repo_copy,
        exit_timeout_s,
        control,
        drain_timeout_s,
        admin_key=key,
        host=_reach(address),
        _log_file=log_file,
    )
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
    """Until /v2/health/ready answers 200 and the metrics endpoint answers too (it can open a moment after the
    HTTP one: a caller that scrapes at once found it refusing)."""
    pending = [f"http://{handle.http_url}/v2/health/ready", handle.metrics_url]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(
                f"tritonserver exited with code {handle.process.returncode} before it was ready"
                + (f"; last log lines:\n{handle.log_tail()}" if handle.log_path else "")
            )
        try:
            with urllib.request.urlopen(pending[0], timeout=2) as resp:
                if resp.status == 200:
                    pending.pop(0)
                    if not pending:
                        return
                    continue
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s (waiting for {pending[0]})")


def _reach(address: str | None) -> str:
    """The host this machine reaches a server bound to `address` at."""
    if not address or address in ("0.0.0.0", "::", "[::]", "127.0.0.1", "localhost"):
        return "localhost"
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _rooted(path: str | Path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else Path.cwd() / path
