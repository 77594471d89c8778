"""tools.isolate_server: CPU lists, and a sweep that pins server processes (by their /proc/<pid>/comm name) to the
server CPUs and every other process to the rest.

The sweep here acts only on processes this test starts (sweep's `pids`), never on the machine: an isolate_server
may be running on it during a measurement, and a sweep over all processes would move that measurement's server.
The processes are `sleep`, started through symlinks whose names make /proc/<pid>/comm read like the server's
(the kernel names a process after the file it executed). They sleep, so the CPUs they may run on cost nothing."""

import os
import signal
import subprocess
import sys

import pytest

from tools import isolate_server as iso

from tests import ROOT


def test_parse_cpus():
    assert iso.parse_cpus("0") == {0}
    assert iso.parse_cpus("0,1") == {0, 1}
    assert iso.parse_cpus("0-3") == {0, 1, 2, 3}
    assert iso.parse_cpus("1,3-4,3") == {1, 3, 4}
    for bad in ("", "a", "1,", "0-", "3-1", "-1", "0-x"):
        with pytest.raises(ValueError, match="CPU list"):
            iso.parse_cpus(bad)


def test_a_bad_cpu_list_is_a_usage_error(capsys, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the CLI swept every process")

    monkeypatch.setattr(iso, "sweep", refuse)  # main() must stop at the argument, never reach a sweep
    with pytest.raises(SystemExit) as e:
        iso.main(["--server-cpus", "0-x"])
    assert e.value.code == 2 and "'0-x'" in capsys.readouterr().err


@pytest.fixture
def sleepers(tmp_path):
    """{name: pid} of `sleep` processes named tritonserver, triton_python_backend_stub, worker and decoy."""
    sleep = "/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep"
    if not sys.platform.startswith("linux") or not os.path.exists(sleep):
        pytest.skip("needs Linux /proc and a sleep binary")
    procs = {}
    try:
        for name in ("tritonserver", "triton_python_backend_stub", "worker", "decoy"):
            (tmp_path / name).symlink_to(sleep)
            procs[name] = subprocess.Popen([str(tmp_path / name), "60"])
        yield {name: p.pid for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_sweep_pins_server_processes_and_the_rest_apart(sleepers):
    every = set(range(os.cpu_count() or 1))
    if len(every) < 2:
        pytest.skip("needs two CPUs")
    try:
        os.sched_setaffinity(sleepers["decoy"], every)
    except OSError as e:
        pytest.skip(f"cannot set CPU affinities here: {e}")
    assert iso.is_server(sleepers["tritonserver"]) and iso.is_server(sleepers["triton_python_backend_stub"])
    assert not iso.is_server(sleepers["worker"]) and not iso.is_server(os.getpid())
    assert not iso.is_server(2**22 + 1)  # no such process
    last = {max(every)}
    servers = (sleepers["tritonserver"], sleepers["triton_python_backend_stub"])
    mine = os.sched_getaffinity(0)
    # A running isolate_server re-pins every process each second (servers to its server CPUs, the rest to the
    # others); it never sets `every`, and a sweep of its that falls between ours and the reads below is retried.
    for _ in range(3):
        for pid in servers:
            os.sched_setaffinity(pid, every)
        os.sched_setaffinity(sleepers["worker"], last)
        os.sched_setaffinity(sleepers["decoy"], last)
        moved = iso.sweep(last, every, pids=[*servers, sleepers["worker"]])
        again = iso.sweep(last, every, pids=[*servers, sleepers["worker"]])  # already where they belong
        got = {name: os.sched_getaffinity(pid) for name, pid in sleepers.items()}
        if got["worker"] == every and again == (0, 0):
            break
    assert moved == (2, 1) and again == (0, 0)
    assert got["tritonserver"] == got["triton_python_backend_stub"] == last and got["worker"] == every
    assert got["decoy"] == last  # not in `pids`: untouched (the sweep would have widened it)
    assert os.sched_getaffinity(0) == mine  # with `pids`, the sweeping process is left alone too
    assert iso.sweep(every, every, pids=[]) == (0, 0)


def test_match_picks_only_the_measured_servers(sleepers, tmp_path):
    # The sleepers run from tmp_path, so their command lines contain it; a test's servers elsewhere would not.
    assert iso.is_server(sleepers["tritonserver"], match=str(tmp_path))
    assert not iso.is_server(sleepers["tritonserver"], match=str(tmp_path / "elsewhere"))
    assert not iso.is_server(sleepers["worker"], match=str(tmp_path))  # matching path, but not a server


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to split")
def test_sigterm_puts_every_process_back_on_all_cpus():
    # a measurement ended by SIGTERM must not leave the machine pinned for the next job (a CI run inherits it)
    script = (
        "import tools.isolate_server as m\n"
        "m.sweep = lambda s, o, **kw: (print('sweep', sorted(s), sorted(o), flush=True), (0, 0))[1]\n"
        "raise SystemExit(m.main(['--server-cpus', '0', '--interval-s', '0.05']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    every = sorted(range(os.cpu_count()))
    try:
        assert proc.stdout.readline().startswith("[isolate] server processes on CPUs [0]")
        assert proc.stdout.readline().strip() == f"sweep [0] {every[1:]}"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert out.strip().splitlines()[-2:] == [
        f"sweep {every} {every}",
        f"[isolate] stopped: every process back on CPUs {every}",
    ]
