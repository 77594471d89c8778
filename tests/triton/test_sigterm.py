"""SIGTERM to the launcher (`python -m trtllm_backend.serve`, what a container runs) with a real tritonserver:
it must exit 0 within drain_timeout_s + 5 s even while a client keeps a gRPC stream open (Triton 2.51 alone
waited its whole exit timeout: trtllm_backend/triton/shutdown.py), and during a burst every accepted request
either completes or gets an error response, none silently dropped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import ROOT

from tests.triton_fixtures import TEST_SERVER_PARAMS, http_ready

from trtllm_backend.serve import free_ports
from tests.triton.test_triton_server import GrpcStream, inputs

pytestmark = [pytest.mark.needs_model, pytest.mark.server]
DRAIN_S = float(TEST_SERVER_PARAMS["drain_timeout_s"])


class Launcher:
    """The CLI launcher as a container runs it, on free ports."""

    def __init__(
        self,
        tmp_path: Path,
        wait_ready: bool = True,
        params: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        ports: tuple[int, int, int] | None = None,
        log_name: str = "launcher.log",
    ):
        self.http, self.grpc, self.metrics = ports or free_ports(3)
        args = [a for k, v in (TEST_SERVER_PARAMS | (params or {})).items() for a in ("--param", f"{k}={v}")]
        self.log_path = tmp_path / log_name
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trtllm_backend.serve",
                "--http-port",
                str(self.http),
                "--grpc-port",
                str(self.grpc),
                "--metrics-port",
                str(self.metrics),
                *args,
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=os.environ | (env or {}),
        )
        deadline = time.monotonic() + 300
        while wait_ready and not self._ready():
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready after 300 s"
            time.sleep(0.5)
        self.grpc_url = f"localhost:{self.grpc}"

    def _ready(self) -> bool:
        return http_ready(f"localhost:{self.http}", timeout_s=2)

    def server_pids(self) -> list[int]:
        """tritonserver and its stubs: every process in the launcher's child's session."""
        out = subprocess.run(["ps", "-eo", "pid,ppid,sid"], capture_output=True, text=True).stdout.split("\n")[1:]
        rows = [tuple(map(int, line.split())) for line in out if line.strip()]
        servers = {pid for pid, ppid, _ in rows if ppid == self.process.pid}
        return [pid for pid, _, sid in rows if sid in servers]

    def sigterm(self) -> tuple[int, float]:
        """SIGTERM the launcher: (its exit status, seconds to exit)."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(DRAIN_S + 30)
        finally:
            self.kill()
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.server_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def launcher(tmp_path):
    srv = Launcher(tmp_path)
    try:
        yield srv
    finally:
        srv.kill()


def test_sigterm_with_an_open_grpc_stream_exits_0_within_drain_plus_5(launcher):
    stream = GrpcStream(launcher.grpc_url)  # as perf_analyzer and genai-perf do: the stream outlives the request
    try:
        done = stream.request(inputs(text_input="Hello there", max_tokens=4, stream=True))
        assert done.error is None and done.counts
        pids = launcher.server_pids()
        code, seconds = launcher.sigterm()
        print(f"[sigterm] open stream: exit {code} after {seconds:.1f} s")
        assert code == 0, launcher.log_path.read_text()[-3000:]
        assert seconds < DRAIN_S + 5
        assert "open gRPC stream" in launcher.log_path.read_text()  # the launcher says why it ended the server
        assert not [p for p in pids if _running(p)]  # tritonserver and its stub are gone
    finally:
        stream.close()


def test_sigterm_while_the_server_starts_stops_it_once_started(tmp_path):
    """A SIGTERM before the launcher has seen the server ready (a client or an orchestrator may be quicker)
    must not kill the launcher with the default action: it stops the server once started, with status 0."""
    srv = Launcher(tmp_path, wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        while not srv.server_pids():  # tritonserver has been started: the launcher is waiting for it
            assert srv.process.poll() is None and time.monotonic() < deadline, srv.log_path.read_text()[-3000:]
            time.sleep(0.05)
        pids = srv.server_pids()
        srv.process.send_signal(signal.SIGTERM)
        code = srv.process.wait(300)
        assert code == 0, srv.log_path.read_text()[-3000:]
        assert not [p for p in pids if _running(p)]
    finally:
        srv.kill()


def test_sigterm_during_a_burst_answers_every_accepted_request(launcher):
    """Long requests the drain cuts off end with an error naming the shutdown; short ones complete; nothing
    ends without a final response or an error."""
    streams = [GrpcStream(launcher.grpc_url) for _ in range(12)]
    results: dict[int, object] = {}

    def run(i: int, s: GrpcStream) -> None:
        long = i % 3 != 0
        n = 400 if long else 4
        s.send(
            inputs(text_input=f"Story {i}: once upon a time", max_tokens=n, min_length=n if long else 0, stream=True)
        )
        try:
            results[i] = s.collect(timeout=DRAIN_S + 30)
        except Exception as exc:  # queue.Empty: nothing final arrived
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    # every request accepted and answered once (the long ones generating, streaming), however slow the machine
    deadline = time.monotonic() + 120
    while not all(s.answered.is_set() for s in streams):
        assert time.monotonic() < deadline, "not every request was answered within 120 s"
        time.sleep(0.05)
    code, seconds = launcher.sigterm()
    for t in threads:
        t.join(DRAIN_S + 35)
    for s in streams:
        s.close()
    print(f"[sigterm] burst: exit {code} after {seconds:.1f} s")
    assert code == 0 and seconds < DRAIN_S + 5, launcher.log_path.read_text()[-3000:]
    assert len(results) == 12
    for i, r in results.items():
        assert not isinstance(r, Exception), f"request {i} got no final response: {r!r}"
        if i % 3 == 0:
            assert r.error is None and sum(r.counts) == 4, (i, r)  # short: completed before the drain ended
        else:
            assert r.error is not None and "shutting down" in r.error, (i, r)  # cut off, and told so
