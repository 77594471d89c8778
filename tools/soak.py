"""Soak: open-loop traffic above capacity against a real tritonserver, with bad requests and cancellations mixed
in, checking that nothing is lost and nothing leaks.

    python -m tools.soak [--minutes 10] [--overload 1.5] [--policy balanced] [--out results/reliability]

1. Starts a server (the launcher, morph_policy --policy) and measures its capacity: the completion rate of a
   closed loop of --concurrency streams with the soak's request mix for --calibrate-s seconds.
2. Sends Poisson arrivals at --overload x that rate for --minutes: 10% bad requests (each must get an error),
   10% cancelled mid-generation (the client closes its stream), the rest ordinary streamed generations.
3. Reports requests sent / completed / rejected (UNAVAILABLE) / errored / cancelled / lost (must be 0), the
   server's invariant violations (must be 0), RSS of tritonserver + stubs every second (growth after warm-up
   under 5%), and open file descriptors, threads and /dev/shm regions before and after (no growth).
Writes soak.json, soak.md and soak_rss.png to --out (the server's log to build/soak_server.log); exits 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import re
import shlex
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tools.capacity.stats import t_quantile
from tools.replay.provenance import code_version, commit_phrase, now_utc
from trtllm_backend.openmp_env import with_openmp_defaults
from trtllm_backend.triton.params import parse_assignment
from trtllm_backend.triton.server import ServerHandle, free_ports, launch

MODEL = "smollm2"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):",
    "List of fruits: apple, banana,",
    "Water boils at a temperature of",
    "The three primary colors are",
]
# Each one must be refused with an error (what the fuzz tests do exhaustively; here: under load).
BAD = [
    dict(text_input=""),
    dict(text_input="Hi", top_p=5.0),
    dict(text_input="Hi", max_tokens=-3),
    dict(text_input="Hi", beam_width=4),
    dict(max_tokens=4),
    dict(text_input=b"\xff\xfe"),
]
TYPES = {
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", np.bool_),
    "top_p": ("FP32", np.float32),
    "beam_width": ("INT32", np.int32),
}
# A small KV pool, so that overload is KV pressure (the balanced policy morphs) as well as a full queue.
SERVER_PARAMS = {
    "max_tokens_in_paged_kv_cache": "512",
    "max_batch_size": "16",
    "max_queue_size": "32",
    "metrics_interval_s": "0.2",
    "drain_timeout_s": "5",
}
GROWTH_LIMIT = 0.05
# An hour-long server must not grow: the slope's 95% interval within this (MiB/min), judged from this many minutes.
SLOPE_LIMIT_MIB_MIN = 0.1
SLOPE_MIN_BINS = 10
# NOTE: a leak grows with the traffic (hundreds of requests per minute here); gRPC/HTTP keep a connection or
# two (and their fds) open after the last request, so one or two more handles at the end are not a leak.
HANDLE_SLACK = 2


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # UNAVAILABLE: the queue was full
    errored: int = 0  # bad requests answered with an error (expected) and any other error
    unexpected_errors: list[str] = field(default_factory=list)
    cancelled: int = 0
    lost: int = 0  # no final response and no error within the timeout
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            if detail and len(self.unexpected_errors) < 20:
                self.unexpected_errors.append(detail)


def _tensors(values: dict) -> list:
    out = []
    for name, value in values.items():
        dtype, np_type = TYPES[name]
        v = value.encode() if isinstance(value, str) else value
        array = np.array([[v]], dtype=np_type)
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def one_request(url: str, kind: str, rng: random.Random, tally: Tally, timeout_s: float) -> None:
    """kind: "ok", "bad" or "cancel"; one stream per request, as the OpenAI gateway does."""
    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        if kind == "bad":
            values = dict(rng.choice(BAD), stream=True)
        else:
            values = dict(text_input=rng.choice(PROMPTS), max_tokens=rng.randint(16, 64), stream=True)
        client.async_stream_infer(MODEL, _tensors(values), enable_empty_final_response=True)
        tally.add("sent")
        if kind == "cancel":
            try:  # cancel mid-generation: after the first token, or whenever it is still queued
                events.get(timeout=rng.uniform(0.2, 3.0))
            except queue.Empty:
                pass
            client.stop_stream(cancel_requests=True)
            tally.add("cancelled")
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tally.add("lost")
                return
            if error is not None:
                message = error.message()
                if "queue full" in message or "UNAVAILABLE" in str(error.status()):
                    tally.add("rejected")
                elif kind == "bad":
                    tally.add("errored")
                else:
                    tally.add("errored", message)
                return
            if result.get_response().parameters["triton_final_response"].bool_param:
                if kind == "bad":
                    tally.add("errored", f"a bad request was served: {values}")
                else:
                    tally.add("completed")
                return
    finally:
        try:
            client.stop_stream()
            client.close()
        except Exception:
            pass


def pick_kind(rng: random.Random) -> str:
    x = rng.random()
    return "bad" if x < 0.1 else "cancel" if x < 0.2 else "ok"


def calibrate(url: str, seconds: float, concurrency: int, seed: int) -> float:
    """Completed requests per second of a closed loop (the capacity the open loop is scaled from)."""
    tally, stop = Tally(), time.monotonic() + seconds

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop:
            one_request(url, pick_kind(rng), rng, tally, 120)

    start = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally.sent / (time.monotonic() - start)


def process_stats(handle: ServerHandle) -> dict[str, int]:
    """RSS, open fds and threads of tritonserver plus its stubs; this server's /dev/shm regions."""
    rss = fds = threads = 0
    for pid in [handle.process.pid, *handle.stub_pids()]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds += len(list(Path(f"/proc/{pid}/fd").iterdir()))
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields["VmRSS"].split()[0]) * 1024
        threads += int(fields["Threads"])
    shm = len(list(Path("/dev/shm").glob(handle.shm_prefix + "*")))
    return {"rss_bytes": rss, "fds": fds, "threads": threads, "shm_regions": shm}


def server_metrics(handle: ServerHandle) -> dict[str, float]:
    text = urllib.request.urlopen(handle.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("morphserve_"):
            key, value = line.rsplit(" ", 1)
            labels = [v for k, v in re.findall(r'(\w+)="([^"]*)"', key) if k not in ("model", "version")]
            out[".".join([key.split("{")[0], *labels])] = float(value)  # e.g. morphserve_requests.active
    return out


def wait_idle(handle: ServerHandle, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics(handle)
        if (
            m.get("morphserve_kv_cache_blocks.used") == 0 and m.get("morphserve_requests.active") == 0
        ) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def morph_state(handle: ServerHandle) -> tuple:
    """(INT4 layers, INT8 head, KV blocks): what the server holds besides its fixed memory (None if the metrics
    do not answer)."""
    try:
        m = server_metrics(handle)
    except OSError:
        return (None,)
    return (m.get("morphserve_int4_layers"), m.get("morphserve_lm_head_int8"), m.get("morphserve_kv_cache_blocks.max"))


def soak(
    handle: ServerHandle, seconds: float, rate: float, seed: int, timeout_s: float
) -> tuple[Tally, list, list, list]:
    """Open loop: Poisson arrivals at `rate` for `seconds`. Sampled every second meanwhile: RSS as (t, bytes), the
    handles as (t, fds, threads, shm regions) and the morph state as (t, state)."""
    tally, rng, samples, handles, states = Tally(), random.Random(seed), [], [], []
    done = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not done.wait(1.0):
            st = process_stats(handle)
            t = time.monotonic() - t0
            samples.append((t, st["rss_bytes"]))
            handles.append((t, st["fds"], st["threads"], st["shm_regions"]))
            states.append((t, morph_state(handle)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(max_workers=512) as pool:
        start = time.monotonic()
        next_at = start
        while next_at < start + seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
            pool.submit(one_request, handle.grpc_url, pick_kind(rng), random.Random(rng.random()), tally, timeout_s)
            next_at += rng.expovariate(rate)
    done.set()
    sampler.join()
    return tally, samples, handles, states


def at_rest(samples: list, states: list, warmup_s: float) -> tuple[list, tuple | None]:
    """The RSS samples taken in the server's most common morph state after warm-up, and that state. Why: swapping
    layers and growing KV segments moves RSS by tens of MiB (freed fragments are not all returned to the system at
    once); a leak is RSS growing while the server holds the same things."""
    after = [st for (t, st) in states if t >= warmup_s and st != (None,)]
    if not after:
        return samples, None
    rest = Counter(after).most_common(1)[0][0]
    return [x for x, (_, st) in zip(samples, states) if st == rest], rest


def rss_growth(samples: list, warmup_s: float) -> float:
    """Median RSS of the last 30 s over the median of the 30 s after warm-up, minus one."""
    after = [r for t, r in samples if warmup_s <= t < warmup_s + 30]
    last = [r for t, r in samples if t >= samples[-1][0] - 30]
    return float(np.median(last) / np.median(after) - 1) if after and last else 0.0


def rss_slope(samples: list, warmup_s: float, bin_s: float = 60.0) -> dict | None:
    """RSS slope after warm-up in MiB/min, least squares over per-minute medians, with a 95% t interval (None with
    fewer than SLOPE_MIN_BINS minutes). Why medians per minute: RSS moves with every burst (KV segments come and
    go as the server morphs); a minute's median keeps the trend and drops most of the autocorrelation that would
    make an interval over 1-s samples far too narrow."""
    bins: dict[int, list[int]] = {}
    for t, r in samples:
        if t >= warmup_s:
            bins.setdefault(int((t - warmup_s) // bin_s), []).append(r)
    full = [(k, np.median(v)) for k, v in sorted(bins.items()) if len(v) >= bin_s / 2]
    if len(full) < SLOPE_MIN_BINS:
        return None
    x = np.array([k for k, _ in full], dtype=float) * bin_s / 60
    y = np.array([m for _, m in full]) / 2**20
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    stderr = math.sqrt(float(resid @ resid) / (len(x) - 2) / float(((x - x.mean()) ** 2).sum()))
    half = t_quantile(0.975, len(x) - 2) * stderr
    return {
        "mib_per_min": float(slope),
        "ci95": [float(slope - half), float(slope + half)],
        "minutes": len(x),
        "bin_s": bin_s,
    }


def handle_ranges(handles: list, warmup_s: float) -> dict[str, list[int]]:
    """Lowest and highest fds, threads and /dev/shm regions after warm-up: flat means a narrow range."""
    after = [h for h in handles if h[0] >= warmup_s] or handles
    return {
        k: [min(h[i] for h in after), max(h[i] for h in after)] if after else [0, 0]
        for i, k in ((1, "fds"), (2, "threads"), (3, "shm_regions"))
    }


def plot(samples: list, warmup_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([t for t, _ in samples], [r / 2**20 for _, r in samples], lw=1)
    ax.axvline(warmup_s, color="grey", ls="--", lw=0.8, label="end of warm-up")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS, tritonserver + stub (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--overload", type=float, default=1.5, help="arrival rate as a multiple of the capacity")
    ap.add_argument("--policy", default="balanced")
    ap.add_argument("--calibrate-s", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop streams of the calibration")
    ap.add_argument("--rate", type=float, help="arrivals per second (skips the calibration)")
    ap.add_argument("--warmup-s", type=float, help="default: a fifth of the run, at least 10 s")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="a request with no final response by then is lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/reliability")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="server parameter, over the soak's own (e.g. num_threads=1 for a server given one core)",
    )
    args = ap.parse_args(argv)
    params = SERVER_PARAMS | {"morph_policy": args.policy} | dict(parse_assignment(a) for a in args.param)
    run = code_version() | {"started_utc": now_utc(), "load_avg_1m_start": round(os.getloadavg()[0], 2)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else max(10.0, seconds / 5)
    with_openmp_defaults(__import__("os").environ)
    http, grpc, metrics = free_ports(3)
    log = Path("build") / "soak_server.log"  # NOTE: not beside the results: it names this machine's paths
    log.parent.mkdir(exist_ok=True)
    handle = launch(http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=log, params=params)
    try:
        one_request(handle.grpc_url, "ok", random.Random(0), Tally(), 120)  # warm: first-call costs
        capacity = None
        if args.rate is None:
            capacity = calibrate(handle.grpc_url, args.calibrate_s, args.concurrency, args.seed)
            rate = capacity * args.overload
        else:
            rate = args.rate
        print(
            f"[soak] capacity {capacity and round(capacity, 2)} req/s; sending {rate:.2f} req/s for {seconds:.0f} s",
            flush=True,
        )
        wait_idle(handle)
        before = process_stats(handle) | {
            "invariant_violations": server_metrics(handle).get("morphserve_invariant_violations_total", 0)
        }
        tally, samples, handles, states = soak(handle, seconds, rate, args.seed + 1, args.timeout_s)
        idle = wait_idle(handle)
        after = process_stats(handle) | {"invariant_violations": idle.get("morphserve_invariant_violations_total", 0)}
        growth = rss_growth(samples, warmup)
        slope = rss_slope(samples, warmup)
        rest_samples, rest = at_rest(samples, states, warmup)
        rest_slope = rss_slope(rest_samples, warmup)
        m = idle
    finally:
        code = handle.stop()
    accounted = tally.completed + tally.rejected + tally.errored + tally.cancelled + tally.lost
    report = (
        {
            "command": "python -m tools.soak "
            + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "seconds": seconds,
            "warmup_s": warmup,
            "policy": args.policy,
            "capacity_req_s": capacity,
            "rate_req_s": rate,
            "overload": args.overload if capacity else None,
            "server_params": params,
            "requests": {
                k: getattr(tally, k)
                for k in ("sent", "completed", "rejected", "errored", "cancelled", "lost", "unexpected_errors")
            }
            | {"unaccounted": tally.sent - accounted},
            "before": before,
            "after": after,
            "rss_growth_after_warmup": growth,
            "rss_slope": slope,
            "rss_slope_at_rest": rest_slope,
            "rest_state": {"int4_layers": rest[0], "lm_head_int8": rest[1], "kv_blocks": rest[2]} if rest else None,
            "rest_share": len(rest_samples) / len(samples) if samples else 0.0,
            "handle_ranges_after_warmup": handle_ranges(handles, warmup),
            "server": {
                k: v
                for k, v in m.items()
                if k.startswith(
                    (
                        "morphserve_layer_swaps_total",
                        "morphserve_kv_resizes",
                        "morphserve_swap_failures",
                        "morphserve_preemptions",
                        "morphserve_requests_total",
                    )
                )
            },
            "rss_samples": samples,
            "server_exit": code,
        }
        | run
        | {"load_avg_1m_end": round(os.getloadavg()[0], 2)}
    )
    checks = {
        "no request lost": tally.lost == 0 and tally.sent == accounted,
        "no unexpected error": not tally.unexpected_errors,
        "no invariant violation": after["invariant_violations"] == 0,
        f"RSS growth after warm-up under {GROWTH_LIMIT:.0%}": growth < GROWTH_LIMIT,
        # NOTE: judged only on a run long enough to have a slope (make soak-hour); shorter runs report none.
        f"RSS slope at rest within +-{SLOPE_LIMIT_MIB_MIN} MiB/min": rest_slope is None
        or (-SLOPE_LIMIT_MIB_MIN <= rest_slope["ci95"][0] and rest_slope["ci95"][1] <= SLOPE_LIMIT_MIB_MIN),
        f"fds and threads within +{HANDLE_SLACK}, no /dev/shm growth": (
            all(after[k] - before[k] <= HANDLE_SLACK for k in ("fds", "threads"))
            and after["shm_regions"] <= before["shm_regions"]
        ),
        "server stopped cleanly": code == 0,
    }
    report["checks"] = checks
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(
        samples,
        warmup,
        out / "soak_rss.png",
        f"soak: {rate:.2f} req/s for {seconds:.0f} s, {args.policy}; RSS growth after warm-up {growth:+.1%}",
    )
    (out / "soak.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if all(checks.values()) else 1


def markdown(r: dict) -> str:
    q, b, a = r["requests"], r["before"], r["after"]
    lines = [
        f"# Soak: {r['seconds']:.0f} s at {r['rate_req_s']:.2f} req/s ({r['policy']})",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Run: {r.get('started_utc', 'start not recorded')}, {commit_phrase(r)}; 1-min load average "
        f"{r.get('load_avg_1m_start', '?')} at start, {r.get('load_avg_1m_end', '?')} at the end.",
        "",
        f"Capacity (closed loop, same mix): {r['capacity_req_s'] and round(r['capacity_req_s'], 2)} req/s; "
        f"overload x{r['overload']}.",
        "",
        "| sent | completed | rejected (UNAVAILABLE) | errored | cancelled | lost |",
        "|---|---|---|---|---|---|",
        f"| {q['sent']} | {q['completed']} | {q['rejected']} | {q['errored']} | {q['cancelled']} | {q['lost']} |",
        "",
        "| | before | after |",
        "|---|---|---|",
    ]
    for k in ("rss_bytes", "fds", "threads", "shm_regions", "invariant_violations"):
        lines.append(f"| {k} | {b[k]} | {a[k]} |")

    def slope(sl):
        return (
            f"{sl['mib_per_min']:+.3f} MiB/min, 95% interval [{sl['ci95'][0]:+.3f}, {sl['ci95'][1]:+.3f}] over "
            f"{sl['minutes']} per-minute medians"
            if sl
            else f"not judged (under {SLOPE_MIN_BINS} minutes)"
        )

    ranges = ", ".join(f"{k} {lo}-{hi}" for k, (lo, hi) in r.get("handle_ranges_after_warmup", {}).items())
    lines += [
        "",
        f"RSS growth after warm-up ({r['warmup_s']:.0f} s): {r['rss_growth_after_warmup']:+.2%}",
        "",
        f"RSS slope after warm-up, every sample: {slope(r.get('rss_slope'))}",
        "",
        f"RSS slope after warm-up, at rest ({r.get('rest_state')}, {r.get('rest_share', 0):.0%} of the samples; "
        f"what the check judges): {slope(r.get('rss_slope_at_rest'))}",
        "",
        f"Handles after warm-up (lowest-highest): {ranges}",
        "",
        "Checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
