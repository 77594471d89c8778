"""Client side of docker/test_compose.sh: real requests to a running MorphServe Triton server.

    python docker/smoke_client.py check --host 127.0.0.1 --http-port 8000 --grpc-port 8001 --metrics-port 8002
    python docker/smoke_client.py load --seconds 30 --concurrency 4      (traffic for the dashboard)
    python docker/smoke_client.py burst --http-port 8000 --grpc-port 8001 --lb-admin-port 8404 \
        --replica-metrics 8102,8202 --requests 16                          (replicas behind the balancer)

`check` sends one streaming gRPC request and one HTTP generate request, then reads /metrics and fails
unless every morphserve_ metric family of the fixed contract is exported.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import queue
import sys
import threading
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

MODEL = "smollm2"
PROMPT = "The capital of France is"
FAMILIES = [
    "morphserve_requests",
    "morphserve_kv_cache_blocks",
    "morphserve_kv_cache_usage_ratio",
    "morphserve_int4_layers",
    "morphserve_kv_capacity_blocks",
    "morphserve_memory_bytes",
    "morphserve_preemptions_total",
    "morphserve_prompt_tokens_total",
    "morphserve_generation_tokens_total",
    "morphserve_requests_total",
    "morphserve_layer_swaps_total",
    "morphserve_kv_resizes_total",
    "morphserve_swap_failures_total",
    "morphserve_time_to_first_token_seconds",
    "morphserve_time_per_output_token_seconds",
    "morphserve_e2e_request_latency_seconds",
    "morphserve_request_queue_time_seconds",
    "morphserve_swap_prepare_seconds",
    "morphserve_swap_apply_seconds",
]


DTYPES = {
    "BYTES": np.object_,
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "FP32": np.float32,
}


def grpc_inputs(client: grpcclient.InferenceServerClient, values: dict) -> list:
    """Inputs typed and shaped from the model's own metadata (-1 -> 1), so the client follows config.pbtxt."""
    meta = {i.name: i for i in client.get_model_metadata(MODEL).inputs}
    out = []
    for name, value in values.items():
        shape = [1 if d == -1 else d for d in meta[name].shape]
        value = value.encode() if isinstance(value, str) else value
        arr = np.array([value], dtype=DTYPES[meta[name].datatype]).reshape(shape)
        inp = grpcclient.InferInput(name, shape, meta[name].datatype)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def grpc_stream(url: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> list[str]:
    """One streaming request; returns the text chunks as they arrived."""
    chunks: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: chunks.put(error or result))
    try:
        inputs = grpc_inputs(client, {"text_input": prompt, "max_tokens": max_tokens, "stream": True})
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        texts, deadline = [], time.monotonic() + timeout
        while True:
            item = chunks.get(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(item, Exception):
                raise item
            params = item.get_response().parameters
            if item.as_numpy("text_output") is not None and item.as_numpy("text_output").size:
                texts.append(b"".join(item.as_numpy("text_output").reshape(-1)).decode())
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                return texts
    finally:
        client.stop_stream()
        client.close()


def http_generate(host: str, port: int, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "stream": False}).encode()
    req = urllib.request.Request(
        f"http://{host}:{port}/v2/models/{MODEL}/generate", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["text_output"]


def metrics(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def check(a) -> int:
    t = time.monotonic()
    chunks = grpc_stream(f"{a.host}:{a.grpc_port}", PROMPT, 16)
    print(f"[smoke] gRPC stream: {len(chunks)} chunks in {time.monotonic() - t:.2f}s: {''.join(chunks)!r}")
    assert len(chunks) >= 2 and "".join(chunks).strip(), "the stream returned no text"
    t = time.monotonic()
    text = http_generate(a.host, a.http_port, PROMPT, 16)
    print(f"[smoke] HTTP generate in {time.monotonic() - t:.2f}s: {text!r}")
    assert text.strip(), "HTTP generate returned no text"
    page = metrics(a.host, a.metrics_port)
    missing = [f for f in FAMILIES if f"# TYPE {f} " not in page]
    print(f"[smoke] /metrics: {len(FAMILIES) - len(missing)}/{len(FAMILIES)} morphserve_ families")
    assert not missing, f"missing metric families: {missing}"
    assert "morphserve_requests_total{" in page and 'status="success"' in page, "no finished request counted"
    return 0


def load(a) -> int:
    """Closed-loop traffic: `concurrency` clients streaming back to back for `seconds` (bounded)."""
    stop, done, errors = time.monotonic() + a.seconds, [0], [0]
    prompts = [
        "Write a short story about a lighthouse keeper.",
        "List five facts about the moon.",
        "Explain how a steam engine works.",
        PROMPT,
    ]

    def worker(i: int) -> None:
        n = i
        while time.monotonic() < stop:
            try:
                grpc_stream(f"{a.host}:{a.grpc_port}", prompts[n % len(prompts)], 24 + 8 * (n % 4))
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 -- counted, the check above is the strict one
                errors[0] += 1
                print(f"[load] error: {exc}", file=sys.stderr)
            n += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"[load] {done[0]} requests, {errors[0]} errors in {a.seconds:.0f}s at concurrency {a.concurrency}")
    return 1 if errors[0] > done[0] else 0


def lb_servers(host: str, admin_port: int) -> dict[tuple[str, str], dict]:
    """HAProxy's per-server rows (backend, server) -> stats, from its CSV stats page."""
    with urllib.request.urlopen(f"http://{host}:{admin_port}/stats;csv", timeout=10) as r:
        rows = csv.DictReader(io.StringIO(r.read().decode().lstrip("# ")))
        return {(row["pxname"], row["svname"]): row for row in rows if row["svname"] not in ("FRONTEND", "BACKEND")}


def successes(host: str, port: int) -> float:
    """morphserve_requests_total{status="success"} of one replica."""
    m = re.search(r'^morphserve_requests_total\{[^}]*status="success"[^}]*\} (\S+)$', metrics(host, port), re.M)
    return float(m.group(1)) if m else 0.0


def burst(a) -> int:
    """A burst through the load balancer, half gRPC streams, half HTTP generate: every request must complete
    with text, both protocols must be routed, and every replica must have served some (its own counter)."""
    ports = [int(p) for p in a.replica_metrics.split(",")]
    deadline = time.monotonic() + 60  # compose's --wait saw the containers ready; HAProxy needs 2 passed checks
    while True:
        servers = lb_servers(a.host, a.lb_admin_port)
        down = [k for k, row in servers.items() if row["status"] != "UP"]
        if not down:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the balancer still sees servers not UP after 60 s: {down}")
        time.sleep(1)
    print(f"[burst] balancer: {len(servers)} servers UP ({', '.join('/'.join(k) for k in sorted(servers))})")
    before = [successes(a.host, p) for p in ports]
    results: list = [None] * a.requests
    prompts = ["Explain how a steam engine works.", "Once upon a time", PROMPT]  # each generates 16 tokens

    def one(i: int) -> None:
        try:
            prompt = prompts[i % len(prompts)]
            if i % 2:
                text = http_generate(a.host, a.http_port, prompt, a.max_tokens)
            else:
                text = "".join(grpc_stream(f"{a.host}:{a.grpc_port}", prompt, a.max_tokens))
            results[i] = text if text.strip() else AssertionError("empty answer")
        except Exception as exc:  # noqa: BLE001 -- reported with its request below
            results[i] = exc

    t = time.monotonic()
    pending = list(range(a.requests))
    while pending:  # `concurrency` requests in flight at once
        batch, pending = pending[: a.concurrency], pending[a.concurrency :]
        threads = [threading.Thread(target=one, args=(i,)) for i in batch]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    took = time.monotonic() - t
    failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception) or r is None}
    assert not failed, f"{len(failed)}/{a.requests} requests through the balancer failed: {failed}"
    time.sleep(0.5)  # the counter is updated as a request finishes; let the last ones land
    served = [successes(a.host, p) - b for p, b in zip(ports, before)]
    rows = lb_servers(a.host, a.lb_admin_port)
    routed = {
        b: sum(int(r["stot"] or 0) for (pb, _), r in rows.items() if pb == b) for b in ("triton_http", "triton_grpc")
    }
    print(
        f"[burst] {a.requests} requests in {took:.1f}s, all completed; served per replica: "
        f"{[int(s) for s in served]}; balancer sessions per backend: {routed}"
    )
    assert all(s >= 1 for s in served), f"a replica served nothing: {served}"
    assert sum(served) == a.requests, f"replicas counted {sum(served)} successes for {a.requests} requests"
    assert routed["triton_http"] >= 1 and routed["triton_grpc"] >= 1, f"a protocol was not routed: {routed}"
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["check", "load", "burst"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="burst: requests sent")
    ap.add_argument("--max-tokens", type=int, default=16, help="burst: tokens per request")
    ap.add_argument("--lb-admin-port", type=int, default=8404, help="burst: HAProxy's stats/health port")
    ap.add_argument("--replica-metrics", default="8102,8202", help="burst: the replicas' metrics ports")
    a = ap.parse_args()
    return {"check": check, "load": load, "burst": burst}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
