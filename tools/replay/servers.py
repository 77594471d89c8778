"""A fresh tritonserver per policy run on free ports (trtllm_backend.triton.server.launch), and waiting for it
to idle."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from tools.replay.paths import REPO_ROOT
from tools.replay.sampler import snapshot
from trtllm_backend.triton.server import free_ports, launch

DYNAMIC = ("accuracy", "balanced", "performance")


def slug(policy: str) -> str:
    """A policy as a file name (int4:15 -> int4-15)."""
    return policy.replace(":", "-")


class Server:
    """A fresh tritonserver for one policy (trtllm_backend.triton.server.launch on free ports)."""

    def __init__(self, policy: str, params: dict[str, str], log_dir: Path):
        http, grpc, metrics = free_ports(3)
        log_dir.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        self.handle = launch(
            REPO_ROOT / "model_repository",
            http_port=http,
            grpc_port=grpc,
            metrics_port=metrics,
            params={**params, "morph_policy": policy},
            backend_dir=REPO_ROOT / "build" / "backends",
            build_dir=REPO_ROOT / "build",
            log_path=log_dir / f"server_{slug(policy)}.log",
            ready_timeout=600,
            exit_timeout_s=15,
        )
        print(f"[compare] {policy}: server ready in {time.monotonic() - t:.0f} s (gRPC :{grpc})", flush=True)

    def __enter__(self):
        return self.handle

    def __exit__(self, *exc):
        self.handle.stop(timeout=30)


def wait_idle(metrics_url: str, dynamic: bool, timeout_s: float = 90.0) -> None:
    """Between sweep points: no request held, and every layer a dynamic policy swapped restored."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            snap = snapshot(resp.read().decode())
        if not snap.get("active") and not (dynamic and snap.get("int4_layers")):
            return
        time.sleep(1.0)
    print(f"[compare] server not idle after {timeout_s:.0f} s; continuing", flush=True)
