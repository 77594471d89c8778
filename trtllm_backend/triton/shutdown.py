"""The drain handshake between the launcher and the model's Python stubs (files in one control folder).

Why not just SIGTERM: Triton 2.51's gRPC frontend keeps the *first* request of every stream (its state is
the stream's AsyncNotifyWhenDone tag) until the client closes the stream, and that request holds the model.
While any client keeps a stream open, the model counts as live, Triton never unloads it (`finalize` never
runs) and the server waits out its whole exit timeout, then hangs in exit until the client goes. So the
launcher asks the stubs to drain directly: it writes `drain`; each stub's watcher sees it, stops admission,
lets running requests finish for `drain_timeout_s`, answers the rest with an error, and writes
`drained.<pid>`; `finalize` writes `finalizing.<pid>` when Triton does unload the model. A model that is
drained but never finalized is held only by such a stream: the launcher may end the server.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import env_vars

CONTROL_DIR_ENV = env_vars.CONTROL_DIR.name  # set by the launcher for tritonserver; the stubs inherit it
DRAIN = "drain"


def control_dir() -> Path | None:
    """The folder the launcher gave this stub, or None (a server started by hand: no handshake)."""
    value = os.environ.get(CONTROL_DIR_ENV)
    return Path(value) if value else None


def request_drain(folder: Path) -> None:
    (folder / DRAIN).touch()


def drain_requested(folder: Path) -> bool:
    return (folder / DRAIN).exists()


def mark(folder: Path, stage: str, pid: int | None = None) -> None:
    """stage: "drained" or "finalizing", for this process (the stub)."""
    (folder / f"{stage}.{os.getpid() if pid is None else pid}").touch()


def count(folder: Path, stage: str) -> int:
    return len(list(folder.glob(f"{stage}.*")))
