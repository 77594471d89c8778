"""Gateway vs. direct: the same concurrent streaming load sent over Triton gRPC and through the OpenAI gateway.

    python -m trtllm_backend.openai.bench --launch            # starts a tritonserver and a gateway, then measures
    python -m trtllm_backend.openai.bench --triton localhost:8001 --gateway http://localhost:9000

Rounds alternate (direct, gateway, direct, ...) so drift on a shared machine hits both. Prints aggregate
output tokens/s and median TTFT for each, side by side. Under 16 streams TTFT is mostly batched prefill, whose
noise dwarfs the gateway's share, so lone requests (one token each, alternating) measure the TTFT the gateway
adds. A script that prints numbers, not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import tritonclient.grpc.aio as grpcaio

from .triton_client import Generation, build_inputs

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Round:
    tokens: int
    wall_s: float
    ttfts: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def prompts(n: int) -> list[str]:
    return [f"Story {i}: once upon a time, in a village by the sea, there lived" + " a" * (i % 5) for i in range(n)]


async def direct_one(client, model: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    done = asyncio.Event()
    request = {
        "model_name": model,
        "inputs": build_inputs(Generation(prompt, max_tokens=max_tokens, temperature=0.0)),
        "parameters": {"triton_enable_empty_final_response": True},
    }

    async def requests():
        yield request
        await done.wait()

    start, ttft, tokens = time.perf_counter(), None, 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(error.message())
        if result.as_numpy("text_output") is not None:
            tokens += int(result.as_numpy("output_token_count").reshape(-1)[0])
            if ttft is None and result.as_numpy("text_output").reshape(-1)[0]:
                ttft = time.perf_counter() - start
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    done.set()
    return tokens, ttft if ttft is not None else float("nan")


async def gateway_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    return tokens, ttft if ttft is not None else float("nan")


async def one_round(send, n: int, max_tokens: int) -> Round:
    start = time.perf_counter()
    results = await asyncio.gather(*(send(p, max_tokens) for p in prompts(n)))
    return Round(sum(t for t, _ in results), time.perf_counter() - start, [f for _, f in results])


async def measure(
    triton: str,
    gateway: str,
    model: str,
    concurrency: int,
    max_tokens: int,
    rounds: int,
    api_key: str | None,
    probes: int,
) -> dict[str, list[Round]]:
    grpc_client = grpcaio.InferenceServerClient(triton)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    http = httpx.AsyncClient(base_url=gateway, timeout=600, limits=limits, headers=headers)
    senders = {
        "direct": lambda p, m: direct_one(grpc_client, model, p, m),
        "gateway": lambda p, m: gateway_one(http, model, p, m),
    }
    out: dict[str, list[Round]] = {"direct": [], "gateway": [], "direct lone": [], "gateway lone": []}
    try:
        for name, send in senders.items():  # warm-up: connections, first-request paths
            await one_round(send, 2, 4)
        for _ in range(rounds):
            for name, send in senders.items():
                out[name].append(await one_round(send, concurrency, max_tokens))
        for _ in range(probes):  # lone requests: TTFT without a batch around it
            for name, send in senders.items():
                out[f"{name} lone"].append(await one_round(send, 1, 1))
    finally:
        await http.aclose()
        await grpc_client.close()
    return out


def report(results: dict[str, list[Round]], concurrency: int, max_tokens: int) -> str:
    lines = [
        f"{concurrency} concurrent streams, up to {max_tokens} output tokens each, {len(results['direct'])} rounds; "
        f"{len(results['direct lone'])} lone one-token requests each (all alternating)",
        f"{'':13} {'tokens':>8} {'tok/s':>9} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12}",
    ]
    summary = {}
    for name, rounds in results.items():
        tokens = sum(r.tokens for r in rounds)
        tok_s = tokens / sum(r.wall_s for r in rounds)
        ttfts = sorted(t for r in rounds for t in r.ttfts)
        p50, p90 = statistics.median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))]
        summary[name] = (tok_s, p50)
        lines.append(f"{name:13} {tokens:8d} {tok_s:9.1f} {p50 * 1e3:12.1f} {p90 * 1e3:12.1f}")
    ratio = summary["gateway"][0] / summary["direct"][0]
    added = (summary["gateway"][1] - summary["direct"][1]) * 1e3
    lone = (summary["gateway lone"][1] - summary["direct lone"][1]) * 1e3
    lines.append(f"gateway/direct throughput at {concurrency} streams: {ratio * 100:.1f}%")
    lines.append(f"median TTFT added by the gateway: {added:+.1f} ms at {concurrency} streams, {lone:+.1f} ms lone")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m trtllm_backend.openai.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--launch", action="store_true", help="start a tritonserver and a gateway on free ports")
    p.add_argument("--triton", default="localhost:8001", help="Triton gRPC address (without --launch)")
    p.add_argument("--gateway", default="http://localhost:9000", help="gateway URL (without --launch)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probes", type=int, default=60, help="lone one-token requests per side")
    args = p.parse_args(argv)
    if not args.launch:
        results = asyncio.run(
            measure(
                args.triton,
                args.gateway,
                args.model,
                args.concurrency,
                args.max_tokens,
                args.rounds,
                args.api_key,
                args.probes,
            )
        )
        print(report(results, args.concurrency, args.max_tokens))
        return
    from trtllm_backend.triton.server import free_ports, launch

    from .process import start_gateway

    logs = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    http, grpc, metrics, port = free_ports(4)
    server = launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        params={"morph_policy": "full", "max_batch_size": str(args.concurrency)},
        backend_dir=ROOT / "build" / "backends",
        build_dir=ROOT / "build",
        log_path=logs / "tritonserver.log",
        ready_timeout=300,
    )
    try:
        gateway = start_gateway(f"localhost:{grpc}", port, log_path=logs / "gateway.log")
        try:
            results = asyncio.run(
                measure(
                    f"localhost:{grpc}",
                    gateway.url,
                    args.model,
                    args.concurrency,
                    args.max_tokens,
                    args.rounds,
                    None,
                    args.probes,
                )
            )
        finally:
            gateway.stop()
    finally:
        server.stop(timeout=20)
    print(report(results, args.concurrency, args.max_tokens))


if __name__ == "__main__":
    main()
