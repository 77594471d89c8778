"""The gateway as a child process (for the launcher, the tests and the benchmark): start, wait ready, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import env_vars


@dataclass
class GatewayProcess:
    process: subprocess.Popen
    port: int
    log_path: Path | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully on SIGTERM
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_gateway(
    triton_grpc: str,
    port: int,
    log_path: Path | None = None,
    api_key: str | None = None,
    extra_args: tuple[str, ...] = (),
    ready_timeout: float = 60.0,
    host: str = "127.0.0.1",
) -> GatewayProcess:
    """`python -m trtllm_backend.openai` on `port`, returned once /health answers 200 (Triton and model ready)."""
    cmd = [
        sys.executable,
        "-m",
        "trtllm_backend.openai",
        "--triton",
        triton_grpc,
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    env = dict(os.environ)
    if api_key:
        env[env_vars.OPENAI_GATEWAY_API_KEY.name] = api_key  # not on the command line, where ps would show it
    out = open(log_path, "ab") if log_path else None  # None: the caller's stdout (the launcher's terminal)
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        if log_path:
            out.close()
    handle = GatewayProcess(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenAI gateway exited with {proc.returncode} (log: {log_path})")
        try:
            with urllib.request.urlopen(f"{handle.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return handle
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    handle.stop()
    raise RuntimeError(f"the OpenAI gateway was not ready within {ready_timeout:.0f} s (log: {log_path})")
