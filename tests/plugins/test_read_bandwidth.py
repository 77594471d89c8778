"""plugins/read_bandwidth.py and its C++ streaming read (csrc/read_stream.cpp): every method measured, the floor the
fastest, the read's checksum the same whatever the threads, load width and prefetch."""

from __future__ import annotations

import pytest
import torch
from tests.plugins.test_cpu_kernels import needs_kernels, ns

from plugins import read_bandwidth


@needs_kernels
@pytest.mark.parametrize("nbytes", [4096 * 3 + 100, 1 << 20])  # a tail past the last whole block; page-aligned slices
def test_the_streaming_read_reads_every_byte_whatever_the_threads_width_and_prefetch(nbytes):
    # 32-bit words whose low byte only is set: no lane can overflow, and the word sums equal the byte sums
    buf = torch.zeros(nbytes // 4, dtype=torch.int32)
    buf.copy_(torch.randint(0, 256, (nbytes // 4,), generator=torch.Generator().manual_seed(nbytes), dtype=torch.int32))
    want = int(buf.sum())
    got = {
        (t, ahead, wide): ns.read_stream(buf, t, ahead, wide)
        for t in (1, 2, 3)
        for ahead in (0, 4096)
        for wide in (False, True)
    }
    assert set(got.values()) == {want}
    with pytest.raises(RuntimeError, match="prefetch distance"):
        ns.read_stream(buf, 1, -1, False)


def test_the_floor_is_the_fastest_method():
    r = read_bandwidth.measure(8 << 20, reps=2, rounds=2)
    assert r["bytes"] == 8 << 20 and r["rounds"] == 2
    assert {"numpy_sum", "torch_sum"} <= set(r["GBps"]) <= set(read_bandwidth.METHODS)
    assert all(v > 0 for v in r["GBps"].values())
    assert r["floor_GBps"] == max(r["GBps"].values()) == r["GBps"][r["floor_method"]]
    if ns is not None:
        assert set(r["GBps"]) == set(read_bandwidth.METHODS)


def test_the_buffer_comes_from_the_allocator_given():
    calls = []

    def alloc(n):
        calls.append(n)
        return torch.empty(n, dtype=torch.uint8)

    r = read_bandwidth.floor_bandwidth(1 << 20, alloc=alloc, rounds=1)
    assert calls == [1 << 20] and r["bytes"] == 1 << 20


def test_the_tool_writes_every_size_and_names_no_path(tmp_path, monkeypatch):
    import json

    from tools import read_bandwidth as tool

    real = tool.subprocess.run

    def run(cmd, *a, **k):  # pgrep answers with a pinned measurement; git (the provenance) runs for real
        if cmd[0] != "pgrep":
            return real(cmd, *a, **k)
        return type(
            "R", (), {"stdout": "1 pgrep -af x\n4242 python -m tools.isolate_server --match /somewhere/else\n"}
        )()

    monkeypatch.setattr(tool.subprocess, "run", run)
    out = tmp_path / "bw.json"
    assert tool.main(["--sizes-mb", "4", "8", "--rounds", "1", "--reps", "1", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    assert [s["bytes"] for s in run["sizes"]] == [4 << 20, 8 << 20]
    assert run["measurements_beside"] == ["python -m tools.isolate_server --match <path>"]
