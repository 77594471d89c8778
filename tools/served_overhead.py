"""Where a served token's time goes: streams through the real Triton server (one at a time by default), the
client's TPOT beside the engine's own (its TPOT histogram) and the CPU time per generated token of every process
and thread on the path (tritonserver, the Python backend stub: engine thread, responder, OpenMP workers; the
client).

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.served_overhead [--policy int4] [--threads 2]
        [--requests 3] [--streams 1] [--prompt-tokens 128] [--output-tokens 128] [--param NAME=VALUE ...]
        [--json FILE]

`--streams N` runs N closed-loop streams at once (`--requests` each, as tools.bench_peers does), so the path's
CPU per token is seen at the concurrency where the engine's OpenMP team shares the cores with it.

If the client's TPOT is well above the engine's, the time goes between the engine and the client (response
path, HTTP); if the two agree, it goes in the engine (bench_engine's step is the comparison). Threads are
listed by their kernel names (Python's are all `triton_python_b`), largest first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from tools.replay.provenance import code_version

TPOT_METRIC = "morphserve_time_per_output_token_seconds"


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds) for every thread of `pid` (gone threads are skipped)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (the stubs of a tritonserver)."""
    kids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                kids.append(int(proc.name))
    return kids


def histogram_sum_count(metrics_text: str, name: str) -> tuple[float, float]:
    """(sum, count) of an unlabelled Prometheus histogram in a /metrics page."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return total, count


def cpu_per_token(before: dict, after: dict, tokens: int, top: int = 6) -> dict:
    """Per process: total CPU ms per token and its largest threads, from two thread_cpu_s snapshots per pid."""
    out = {}
    for pid, now in after.items():
        rows = sorted(
            ((cpu - before[pid].get(tid, (name, 0.0))[1], tid, name) for tid, (name, cpu) in now.items()), reverse=True
        )
        out[pid] = {
            "ms_per_token": 1e3 * sum(r[0] for r in rows) / tokens,
            "threads": [
                {"tid": tid, "name": name, "ms_per_token": 1e3 * d / tokens} for d, tid, name in rows[:top] if d > 0
            ],
        }
    return out


async def _streams(url: str, prompts, streams: int, per_stream: int, output_tokens: int):
    from tools.bench_peers import run_level
    from tools.replay.client import HttpSseTarget

    target = HttpSseTarget(url)
    try:
        return (await run_level(target, prompts, streams, per_stream, output_tokens))[0]
    finally:
        await target.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.served_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--policy", default="int4")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--weight-dtype", default="float16", choices=["auto", "float32", "float16"])
    ap.add_argument(
        "--requests", type=int, default=3, help="measured requests per stream, one after another (after a warm-up)"
    )
    ap.add_argument("--streams", type=int, default=1, help="closed-loop streams at once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="another model parameter")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.streams < 1 or args.output_tokens < 2:
        ap.error("--requests and --streams must be >= 1 and --output-tokens >= 2")
    params = {"morph_policy": args.policy, "weight_dtype": args.weight_dtype, "num_threads": str(args.threads)}
    if args.streams > 1:
        params["max_batch_size"] = str(args.streams)  # as tools.bench_peers sizes its servers
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--param {item!r}: NAME=VALUE expected")
        params[name] = value

    from tools.bench_peers import make_prompts
    from trtllm_backend.serve import free_ports, launch

    load_start = round(os.getloadavg()[0], 2)
    prompts = make_prompts(args.streams * args.requests + 1, args.prompt_tokens)
    http, grpc, metrics = free_ports(3)
    server = launch(params=params, http_port=http, grpc_port=grpc, metrics_port=metrics)
    try:
        pids = [server.process.pid, *children(server.process.pid)]
        names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids}
        metrics_url = f"http://localhost:{metrics}/metrics"
        asyncio.run(_streams(server.http_url, prompts[:1], 1, 1, args.output_tokens))  # warm-up
        before = {pid: thread_cpu_s(pid) for pid in pids}
        m0 = histogram_sum_count(urllib.request.urlopen(metrics_url).read().decode(), TPOT_METRIC)
        c0, w0 = os.times(), time.monotonic()
        records = asyncio.run(_streams(server.http_url, prompts[1:], args.streams, args.requests, args.output_tokens))
        wall, c1 = time.monotonic() - w0, os.times()
        after = {pid: thread_cpu_s(pid) for pid in pids}
        m1 = histogram_sum_count(urllib.request.urlopen(metrics_url).read().decode(), TPOT_METRIC)
    finally:
        server.stop()
    failed = [r for r in records if r.status != "ok" or len(r.token_s) < 2]
    if failed:
        print(f"[overhead] {len(failed)} request(s) failed: {failed[0].error}", file=sys.stderr)
        return 1
    tokens = sum(len(r.token_s) for r in records)
    client_tpot = [(r.token_s[-1] - r.token_s[0]) / (len(r.token_s) - 1) for r in records]
    engine_tpot = (m1[0] - m0[0]) / (m1[1] - m0[1]) if m1[1] > m0[1] else float("nan")
    client_cpu = c1.user + c1.system - c0.user - c0.system
    procs = cpu_per_token(before, after, tokens)
    result = {
        "command": "python -m tools.served_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        **code_version(),
        "load_avg_1m_start": load_start,
        "params": params,
        "tokens": tokens,
        "wall_s": wall,
        "client_tpot_s": client_tpot,
        "engine_tpot_s": engine_tpot,
        "client_cpu_ms_per_token": 1e3 * client_cpu / tokens,
        "processes": {names[pid]: procs[pid] for pid in pids},
        "openmp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
    }
    print(
        f"[overhead] {args.policy}, {args.threads} threads, {args.streams} stream(s) at once of {args.requests} "
        f"request(s) each, {args.output_tokens} tokens after a {args.prompt_tokens}-token prompt: "
        f"{tokens / wall:.1f} output tok/s"
    )
    tpots = sorted(client_tpot)
    print(
        f"[overhead] TPOT: client median {tpots[len(tpots) // 2] * 1e3:.2f} ms (of {len(tpots)}); "
        f"engine {engine_tpot * 1e3:.2f} ms"
    )
    print(f"[overhead] CPU per generated token (prefill included): client {result['client_cpu_ms_per_token']:.3f} ms")
    for pid in pids:
        p = procs[pid]
        print(
            f"[overhead]   {names[pid]} (pid {pid}): {p['ms_per_token']:.3f} ms; threads: "
            + ", ".join(f"{t['tid']} {t['ms_per_token']:.3f}" for t in p["threads"])
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
