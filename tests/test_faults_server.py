"""Faults with a real tritonserver: a corrupt fragment at swap time (the swap fails, serving goes on, the
failure counter moves, the layer keeps its binding) and the Python stub killed (the launcher exits 1, so a
supervisor restarts it; the Docker test checks the restart policy). SIGTERM faults: tests/test_sigterm.py."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import ROOT, TEST_SERVER_PARAMS, free_ports
from engine_fixtures import damaged_fragment_copy
from test_sigterm import Launcher, _running
from test_triton_server import GrpcStream, inputs, metrics, wait_for


pytestmark = [pytest.mark.needs_model, pytest.mark.server]


def test_corrupt_fragment_at_swap_time_over_the_wire(tmp_path, monkeypatch):
    from trtllm_backend import serve

    frags, _ = damaged_fragment_copy(tmp_path / "fragments")
    monkeypatch.setenv("MORPHSERVE_FORCE_MORPH", "down:1@1")  # the test hook reaches the stub through the env
    http, grpc, metrics_port = free_ports(3)
    srv = serve.launch(ROOT / "model_repository", http_port=http, grpc_port=grpc, metrics_port=metrics_port,
                       params=TEST_SERVER_PARAMS | {"fragment_dir": str(frags)}, build_dir=tmp_path,
                       log_path=tmp_path / "server.log", exit_timeout_s=10)
    try:
        s = GrpcStream(srv.grpc_url)
        for i in range(3):  # served through the failed swap and after it
            r = s.request(inputs(text_input=f"Request {i}: the capital of France is", max_tokens=8, stream=True))
            assert r.error is None and sum(r.counts) == 8, r
        s.close()
        m = wait_for(lambda: (lambda m: m if m.get("morphserve_swap_failures_total") == 1 else None)(metrics(srv)),
                     timeout=30)
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
