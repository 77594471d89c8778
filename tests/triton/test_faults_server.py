"""Faults with a real tritonserver: a corrupt fragment at swap time (the swap fails, serving goes on, the
failure counter moves, the layer keeps its binding); the Python stub killed (the launcher exits 1, so a
supervisor restarts it; the Docker test checks the restart policy); the stub or tritonserver killed while a
restore drains its KV segment (the launcher exits non-zero, leaves no shared memory or files, and a restart on
the same ports serves); the server's log on a full disk; the metrics port taken, or its endpoint held by a
client that never finishes its request. SIGTERM faults: tests/triton/test_sigterm.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests import ROOT

from tests.triton_fixtures import TEST_SERVER_PARAMS

from trtllm_backend.serve import free_ports
from trtllm_backend.triton.server import SHM_PREFIX
from tests.engine_fixtures import damaged_fragment_copy
from tests.triton.test_sigterm import Launcher, _running
from tests.triton.test_triton_server import GrpcStream, inputs, metrics, wait_for


pytestmark = [pytest.mark.needs_model, pytest.mark.server]


def test_corrupt_fragment_at_swap_time_over_the_wire(tmp_path, monkeypatch):
    from trtllm_backend import serve

    frags, _ = damaged_fragment_copy(tmp_path / "fragments")
    monkeypatch.setenv("MORPHSERVE_FORCE_MORPH", "down:1@1")  # the test hook reaches the stub through the env
    http, grpc, metrics_port = free_ports(3)
    srv = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics_port,
        params=TEST_SERVER_PARAMS | {"fragment_dir": str(frags)},
        build_dir=tmp_path,
        log_path=tmp_path / "server.log",
        exit_timeout_s=10,
    )
    try:
        s = GrpcStream(srv.grpc_url)
        for i in range(3):  # served through the failed swap and after it
            r = s.request(inputs(text_input=f"Request {i}: the capital of France is", max_tokens=8, stream=True))
            assert r.error is None and sum(r.counts) == 8, r
        s.close()
        m = wait_for(
            lambda: (lambda m: m if m.get("morphserve_swap_failures_total") == 1 else None)(metrics(srv)), timeout=30
        )
        assert m, metrics(srv)
        assert m["morphserve_int4_layers"] == 0 and m["morphserve_invariant_violations_total"] == 0
        assert "cannot load layer" in srv.log_path.read_text()
    finally:
        assert srv.stop() == 0
    assert not srv.stub_died


def test_stub_killed_the_launcher_exits_1(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        pids = launcher.server_pids()
        (stub,) = [p for p in pids if "stub" in open(f"/proc/{p}/cmdline").read()]
        start = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        code = launcher.process.wait(60)
        seconds = time.monotonic() - start
        print(f"[faults] stub killed: launcher exit {code} after {seconds:.1f} s")
        assert code == 1, launcher.log_path.read_text()[-3000:]
        assert "stub exited" in launcher.log_path.read_text()
        assert not [p for p in pids if _running(p)]  # tritonserver went with it
    finally:
        launcher.kill()


def _shm_prefix(pids: list[int]) -> str:
    """The Python backend's shared-memory prefix this server was started with (each server has its own)."""
    for pid in pids:
        for arg in Path(f"/proc/{pid}/cmdline").read_text().split("\0"):
            if "shm-region-prefix-name=" in arg:
                return arg.split("shm-region-prefix-name=")[1]
    raise AssertionError(f"no shm-region-prefix-name in the command lines of {pids}")


def _repo_copies() -> set[str]:
    return {p.name for p in (ROOT / "build").glob("model_repository.*")}


def _until(cond, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not seen in {timeout:.0f} s; log tail:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.parametrize("victim", ["stub", "tritonserver"])
def test_killed_mid_restore_then_a_restart_serves(tmp_path, victim):
    # Two layers swapped down at once, then more long requests than the KV pool holds (each fits the base pool
    # of ~400 tokens, as admission requires), so the forced restore
    # at iteration 150 finds the pool full: its segment drains while they run, then each unit is staged
    # (hundreds of ms). The process is killed as soon as the restore is logged, before both units are back.
    copies = _repo_copies()
    params = {"max_tokens_in_paged_kv_cache": "512", "max_batch_size": "8", "default_max_tokens": "300"}
    launcher = Launcher(tmp_path, params=params, env={"MORPHSERVE_FORCE_MORPH": "down:2@1,up:2@150"})
    streams = []
    try:
        for i in range(8):
            s = GrpcStream(launcher.grpc_url)
            s.send(inputs(text_input=f"Story {i}: once upon a time", max_tokens=300, stream=True, min_length=300))
            streams.append(s)
        log = launcher.log_path
        _until(lambda: "restore 2 unit(s)" in log.read_text(), 300, "the forced restore", log)
        pids = launcher.server_pids()
        prefix = _shm_prefix(pids)
        assert prefix.startswith(SHM_PREFIX) and list(Path("/dev/shm").glob(prefix + "*"))
        target = [
            p
            for p in pids
            if ("stub" in open(f"/proc/{p}/cmdline").read()) == (victim == "stub")
            and (victim == "stub" or "tritonserver" in open(f"/proc/{p}/cmdline").read())
        ]
        assert len(target) == 1, (victim, pids)
        os.kill(target[0], signal.SIGKILL)
        code = launcher.process.wait(60)
        restored = launcher.log_path.read_text().split("restore 2 unit(s)")[1].count("-> full")
        print(f"[faults] {victim} killed mid-restore ({restored} of 2 units back): launcher exit {code}")
        assert restored < 2  # killed with the restore half done
        assert code != 0, log.read_text()[-3000:]
        assert not [p for p in pids if _running(p)]  # nothing of the server is left running
    finally:
        for s in streams:
            s.close()
        launcher.kill()
    assert not list(Path("/dev/shm").glob(prefix + "*"))  # no shared memory left
    assert _repo_copies() <= copies  # nor the model repository copy the launcher made
    # What a supervisor does: start it again on the same ports. It serves.
    again = Launcher(tmp_path, ports=(launcher.http, launcher.grpc, launcher.metrics), log_name="restart.log")
    try:
        s = GrpcStream(again.grpc_url)
        r = s.request(inputs(text_input="After the restart, the capital of France is", max_tokens=8, stream=True))
        s.close()
        assert r.error is None and sum(r.counts) == 8, r
    finally:
        assert again.sigterm()[0] == 0


def test_a_full_disk_under_the_server_log_does_not_stop_serving(tmp_path):
    from trtllm_backend import serve

    http, grpc, metrics_port = free_ports(3)
    # /dev/full fails every write with ENOSPC: Triton's log, the stub's stderr (every INFO line of the engine)
    srv = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics_port,
        params=TEST_SERVER_PARAMS | {"morph_policy": "balanced"},
        build_dir=tmp_path,
        log_path="/dev/full",
        exit_timeout_s=10,
    )
    try:
        s = GrpcStream(srv.grpc_url)
        for i in range(3):
            r = s.request(inputs(text_input=f"Request {i}: water boils at", max_tokens=8, stream=True))
            assert r.error is None and sum(r.counts) == 8, r
        s.close()
        assert metrics(srv)["morphserve_invariant_violations_total"] == 0
    finally:
        assert srv.stop() == 0
    assert not srv.stub_died


def test_the_metrics_port_taken_fails_the_start_and_names_it(tmp_path):
    import socket

    http, grpc, metrics_port = free_ports(3)
    squatter = socket.socket()
    squatter.bind(("0.0.0.0", metrics_port))
    squatter.listen()
    try:
        launcher = Launcher(tmp_path, wait_ready=False, ports=(http, grpc, metrics_port))
        try:
            code = launcher.process.wait(300)
        finally:
            launcher.kill()
    finally:
        squatter.close()
    text = launcher.log_path.read_text()
    assert code != 0 and str(metrics_port) in text, text[-3000:]


def test_a_metrics_client_that_never_finishes_does_not_stop_inference(tmp_path):
    import socket

    from trtllm_backend import serve

    http, grpc, metrics_port = free_ports(3)
    srv = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics_port,
        params=TEST_SERVER_PARAMS,
        build_dir=tmp_path,
        log_path=tmp_path / "server.log",
        exit_timeout_s=10,
    )
    stalled = []
    try:
        for _ in range(8):  # scrapers that send half a request and hold the connection
            c = socket.create_connection(("127.0.0.1", metrics_port), timeout=10)
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            stalled.append(c)
        s = GrpcStream(srv.grpc_url)
        r = s.request(inputs(text_input="The three primary colors are", max_tokens=8, stream=True))
        s.close()
        assert r.error is None and sum(r.counts) == 8, r
        assert "morphserve_kv_cache_blocks" in str(metrics(srv))  # a well-behaved scraper is still answered
    finally:
        for c in stalled:
            c.close()
        assert srv.stop() == 0
