"""trtllm_backend.triton.server without a model: free ports, launch's early refusals, and the ServerHandle
lifecycle around a stand-in process group (a shell with two children in place of tritonserver and its stubs;
tests/triton/test_triton_server.py covers the same handle around the real server)."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from trtllm_backend.triton.server import SHM_PREFIX, ServerHandle, free_ports, launch


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_launch_refuses_a_repository_without_the_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.pbtxt not found"):
        launch(tmp_path, model="nope")


def _stand_in(tmp_path: Path, **kwargs) -> ServerHandle:
    process = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    handle = ServerHandle(process, 0, 0, 0, "m", f"{SHM_PREFIX}test{uuid.uuid4().hex[:8]}_", exit_timeout_s=2, **kwargs)
    deadline = time.monotonic() + 10
    while len(handle.stub_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return handle


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_stop_ends_the_group_and_removes_what_the_server_left(tmp_path):
    copy = tmp_path / "model_repository.copy"
    copy.mkdir()
    handle = _stand_in(tmp_path, repo_copy=copy)
    children = handle.stub_pids()
    assert len(children) == 2 and handle.alive()
    mine = Path("/dev/shm") / f"{handle.shm_prefix}0"
    other = Path("/dev/shm") / f"{SHM_PREFIX}other{uuid.uuid4().hex[:8]}_0"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        handle.stop()
        assert not handle.alive() and handle.stopping
        assert all(_gone(pid) for pid in children)  # orphaned children of the group are ended too
        assert not mine.exists() and other.exists()  # only this server's regions
        assert not copy.exists()
    finally:
        other.unlink(missing_ok=True)
        handle.stop()


# Triton 2.51 sometimes aborts by itself within the watcher's poll interval of a stub's death: that counts too
@pytest.mark.parametrize(
    "interval, server_aborts", [(0.05, False), (2.0, True)], ids=["watcher-stops-it", "aborts-itself"]
)
def test_a_dead_child_stops_the_server_and_counts_as_a_stub_death(tmp_path, interval, server_aborts):
    handle = _stand_in(tmp_path)
    try:
        watcher = handle.watch_stubs(interval=interval)
        subprocess.run(["kill", "-KILL", str(handle.stub_pids()[0])], check=True)
        if server_aborts:
            handle.process.kill()
        watcher.join(timeout=15)
        assert handle.stub_died and not handle.alive()
    finally:
        handle.stop()


def test_stop_after_the_server_aborted_by_itself_reports_the_stub_death_before_the_watcher_wakes(tmp_path):
    # serve's main loop calls stop() as soon as it sees the server gone; the watcher may still be asleep
    handle = _stand_in(tmp_path)
    try:
        handle.watch_stubs(interval=60.0)
        stub = handle.stub_pids()[0]
        subprocess.run(["kill", "-KILL", str(stub)], check=True)
        # NOTE: a signal is delivered asynchronously: on a busy machine the stub may run on for a moment after
        # kill returns; Triton aborts only once the stub is really gone, so wait for that as the server would
        deadline = time.monotonic() + 10
        while not _gone(stub) and time.monotonic() < deadline:
            time.sleep(0.01)
        handle.process.kill()
        handle.process.wait()
        handle.stop()
        assert handle.stub_died
    finally:
        handle.stop()


def test_a_server_that_dies_with_its_stubs_running_is_not_a_stub_death(tmp_path):
    handle = _stand_in(tmp_path)
    try:
        watcher = handle.watch_stubs(interval=0.05)
        handle.process.kill()  # the stubs are orphaned, still running
        watcher.join(timeout=15)
        assert not watcher.is_alive() and not handle.stub_died
    finally:
        handle.stop()


def test_a_normal_stop_is_not_a_stub_death(tmp_path):
    handle = _stand_in(tmp_path)
    watcher = handle.watch_stubs(interval=0.05)
    handle.stop()
    watcher.join(timeout=15)
    assert not handle.stub_died
