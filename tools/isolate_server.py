"""Give the server a core of its own while a measurement runs on a shared machine.

Every second: the server's processes (tritonserver and its Python backend stubs, every thread) are pinned to
`--server-cpus`, every other process that may be pinned to `--other-cpus`. Children inherit their parent's
affinity, so work started later (tests, builds, the load generator) lands on the other cores too. Linux only;
pinning processes you do not own needs root. Stopped with Ctrl-C or SIGTERM it puts every process back on all
cores (pins left behind would halve the next job's machine: a CI run inherits them); after a SIGKILL run
`--release`.

    python -m tools.isolate_server --server-cpus 0 --other-cpus 1 &
    python -m tools.capacity ... --param num_threads=1
    python -m tools.isolate_server --release

Why: a capacity probe on a 2-core machine shared with other work measures the machine's load as much as the
server (docs/capacity.md). With one engine thread pinned alone on a core, only memory bandwidth is shared.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterable

SERVER_NAMES = ("tritonserver", "triton_python_")  # /proc/<pid>/comm is cut at 15 characters


def parse_cpus(spec: str) -> set[int]:
    """'0', '0,1' or '0-3' -> a set of CPU numbers."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a CPU number or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a range of CPU numbers (low-high, low <= high)")
        cpus.update(range(first, last + 1))
    return cpus


def is_server(pid: int, match: str | None = None) -> bool:
    """A tritonserver or one of its stubs; with `match`, only one whose command line contains it (the measured
    server's model repository path, so servers that tests start elsewhere stay on the other CPUs)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            if not f.read().strip().startswith(SERVER_NAMES):
                return False
        if match is None:
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return match.encode() in f.read()
    except OSError:
        return False


def pin(pid: int, cpus: set[int]) -> bool:
    """Pin every thread of `pid`; False when it is gone or may not be pinned (kernel threads)."""
    changed = False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
                changed = True
        except OSError:
            pass
    return changed


def sweep(
    server_cpus: set[int], other_cpus: set[int], pids: Iterable[int] | None = None, match: str | None = None
) -> tuple[int, int]:
    """One pass over /proc: (server processes moved, other processes moved). `pids`: only these processes (this
    process is then left alone too); by default every process, this one on the other CPUs."""
    moved_server = moved_other = 0
    only = None if pids is None else set(pids)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if only is not None and pid not in only:
            continue
        if is_server(pid, match):
            moved_server += pin(pid, server_cpus)
        elif pid != os.getpid():
            moved_other += pin(pid, other_cpus)
    if only is None:
        pin(os.getpid(), other_cpus)
    return moved_server, moved_other


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--other-cpus", default=None, help="default: every other CPU")
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument(
        "--match",
        default=None,
        help="only server processes whose command line contains this (e.g. the measuring checkout's path)",
    )
    ap.add_argument("--release", action="store_true", help="put every process back on all CPUs and exit")
    args = ap.parse_args(argv)
    every = set(range(os.cpu_count() or 1))
    if args.release:
        sweep(every, every)
        print(f"[isolate] every process back on CPUs {sorted(every)}")
        return 0
    try:
        server = parse_cpus(args.server_cpus)
        other = parse_cpus(args.other_cpus) if args.other_cpus else every - server
    except ValueError as e:
        ap.error(str(e))
    if not server or not other or not (server | other) <= every:
        ap.error(f"need non-empty CPU sets within {sorted(every)}: server {sorted(server)}, other {sorted(other)}")
    print(f"[isolate] server processes on CPUs {sorted(server)}, everything else on {sorted(other)}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            s, o = sweep(server, other, match=args.match)
            if s or o:
                print(f"[isolate] pinned {s} server and {o} other processes", flush=True)
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        sweep(every, every)
        print(f"[isolate] stopped: every process back on CPUs {sorted(every)}", flush=True)
        return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
