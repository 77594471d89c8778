"""trtllm_backend.triton.shutdown and ServerHandle.stop's use of it, around a stand-in process group: a
"tritonserver" that ignores SIGTERM (as one held by an open gRPC stream does) and one "stub" child.
tests/triton/test_sigterm.py covers the same with the real server."""

from __future__ import annotations

import subprocess
import time
import uuid

from trtllm_backend.triton import shutdown
from trtllm_backend.triton.server import SHM_PREFIX, ServerHandle


def test_the_handshake_files(tmp_path, monkeypatch):
    monkeypatch.delenv(shutdown.CONTROL_DIR_ENV, raising=False)
    assert shutdown.control_dir() is None  # a server started by hand: no handshake
    monkeypatch.setenv(shutdown.CONTROL_DIR_ENV, str(tmp_path))
    assert shutdown.control_dir() == tmp_path
    assert not shutdown.drain_requested(tmp_path)
    shutdown.request_drain(tmp_path)
    assert shutdown.drain_requested(tmp_path)
    shutdown.mark(tmp_path, "drained", pid=11)
    shutdown.mark(tmp_path, "drained", pid=12)
    assert shutdown.count(tmp_path, "drained") == 2 and shutdown.count(tmp_path, "finalizing") == 0


def _held_server(control, drains: bool) -> ServerHandle:
    """A group leader ignoring SIGTERM with one child; the child plays a stub that drains when asked."""
    stub = (
        f"while [ ! -e {control}/drain ]; do sleep 0.05; done; touch {control}/drained.$$; sleep 300"
        if drains
        else "sleep 300"
    )
    process = subprocess.Popen(
        ["bash", "-c", f"trap '' TERM; bash -c '{stub}' & wait; sleep 300"], start_new_session=True
    )
    handle = ServerHandle(
        process, 0, 0, 0, "m", f"{SHM_PREFIX}test{uuid.uuid4().hex[:8]}_", control_dir=control, drain_timeout_s=2.0
    )
    deadline = time.monotonic() + 10
    while not handle.stub_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    return handle


def test_a_drained_server_held_up_is_ended_with_status_0(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    handle = _held_server(control, drains=True)
    start = time.monotonic()
    assert handle.stop() == 0
    assert handle.drained_but_held and not handle.alive()
    assert time.monotonic() - start < 2.0 + 5  # drain_timeout_s + 5
    assert not control.exists()  # removed with the server


def test_a_server_that_never_drains_is_killed_and_says_so(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    handle = _held_server(control, drains=False)
    start = time.monotonic()
    code = handle.stop()
    assert code != 0 and not handle.drained_but_held and not handle.alive()
    # waited the whole drain_timeout_s + 4 s before the SIGKILL (a lower bound: a loaded machine only adds to
    # it), and then did not hang (a generous upper bound)
    assert 2.0 + 4 <= time.monotonic() - start < 2.0 + 4 + 30
