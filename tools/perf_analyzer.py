"""perf_analyzer 2.51 against the running server: a --streaming concurrency sweep on real prompts.

    python -m tools.perf_analyzer [--url localhost:8001] [--concurrency 1:4] [--max-tokens 32]
        [--corpus ../shared/data/corpus/austen_novels.txt] [--out-dir build/perf] [-- extra perf_analyzer args]

Installs perf_analyzer from the tritonclient==2.51.0 wheel into build/perf_analyzer (newer builds need
glibc 2.38), gives it libb64 and libcudart.so.12 (the copies inside nvidia-pytriton; apt's libb64-0d when
neither the system nor the wheel has one), writes an input JSON of prompts cut from the corpus, runs the
sweep and prints TTFT / tokens per second per concurrency from perf_analyzer's profile export.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "austen_novels.txt"
PA_VERSION = "2.51.0"


# --- install ----------------------------------------------------------------------------------------------------
def _pytriton_libs() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"


def _system_has(soname: str) -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return soname in out


def _link_vendored(lib_dir: Path, soname: str, pattern: str) -> bool:
    found = sorted(_pytriton_libs().glob(pattern))
    if not found:
        return False
    link = lib_dir / soname
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(found[0])
    return True


def ensure_perf_analyzer(install_dir: Path) -> tuple[Path, dict[str, str]]:
    """-> (binary, environment to run it in). Idempotent."""
    binary = install_dir / "bin" / "perf_analyzer"
    if not binary.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(install_dir),
                f"tritonclient=={PA_VERSION}",
            ],
            check=True,
        )
    lib_dir = install_dir / "lib"
    lib_dir.mkdir(exist_ok=True)
    # NOTE: a CPU-only machine has no CUDA runtime; perf_analyzer only needs the library to load.
    if not _link_vendored(lib_dir, "libcudart.so.12", "libcudart-*.so.12*"):
        raise RuntimeError("no libcudart.so.12 in nvidia-pytriton: install nvidia-pytriton==0.7.0")
    if not _system_has("libb64.so.0d") and not _link_vendored(lib_dir, "libb64.so.0d", "libb64-*.so.0d"):
        subprocess.run(["apt-get", "install", "-y", "libb64-0d"], check=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    return binary, env


# --- input data -------------------------------------------------------------------------------------------------
def corpus_prompts(corpus: Path, count: int, words: int) -> list[str]:
    """`count` prose paragraphs spread evenly through the corpus, each cut to its first `words` words."""
    paragraphs = [" ".join(p.split()) for p in corpus.read_text(encoding="utf-8").split("\n\n")]
    prose = [p for p in paragraphs if len(p.split()) >= words]
    if len(prose) < count:
        raise ValueError(f"{corpus} has only {len(prose)} paragraphs of {words}+ words")
    step = len(prose) // count
    return [" ".join(prose[i * step].split()[:words]) for i in range(count)]


def write_input_json(prompts: list[str], max_tokens: int, path: Path) -> Path:
    # Shapes without the batch dimension (perf_analyzer adds it: the model's max_batch_size is 1).
    data = [
        {"text_input": [p], "max_tokens": [max_tokens], "stream": [True], "exclude_input_in_output": [True]}
        for p in prompts
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}, indent=1))
    return path


# --- results ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class LevelSummary:
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    e2e_p50_ms: float
    output_tokens: int
    tokens_per_s: float  # all output tokens of the level / its wall time
    requests_per_s: float


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tokens_in(response: dict) -> int:
    """output_token_count of one streamed response (perf_analyzer exports outputs as values or strings)."""
    value = response.get("output_token_count")
    if isinstance(value, dict):  # {"data": [...]} in some exporter versions
        value = value.get("data")
    if isinstance(value, list):
        value = value[0] if value else 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1 if response.get("text_output") else 0


def summarize(profile: dict) -> list[LevelSummary]:
    levels = []
    for exp in profile.get("experiments", []):
        reqs = [r for r in exp.get("requests", []) if r.get("response_timestamps")]
        if not reqs:
            continue
        ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs]
        e2e = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in reqs]
        tokens = sum(_tokens_in(o) for r in reqs for o in r.get("response_outputs", []))
        wall_s = (max(r["response_timestamps"][-1] for r in reqs) - min(r["timestamp"] for r in reqs)) / 1e9
        levels.append(
            LevelSummary(
                int(exp["experiment"]["value"]),
                len(reqs),
                _percentile(ttft, 0.5),
                _percentile(ttft, 0.9),
                _percentile(e2e, 0.5),
                tokens,
                tokens / wall_s if wall_s > 0 else float("nan"),
                len(reqs) / wall_s if wall_s > 0 else float("nan"),
            )
        )
    return levels


def format_table(levels: list[LevelSummary]) -> str:
    lines = ["concurrency  requests  TTFT p50 ms  TTFT p90 ms  e2e p50 ms  out tokens  tokens/s  req/s"]
    for lv in levels:
        lines.append(
            f"{lv.concurrency:>11}  {lv.requests:>8}  {lv.ttft_p50_ms:>11.1f}  {lv.ttft_p90_ms:>11.1f}  "
            f"{lv.e2e_p50_ms:>10.1f}  {lv.output_tokens:>10}  {lv.tokens_per_s:>8.1f}  "
            f"{lv.requests_per_s:>5.2f}"
        )
    return "\n".join(lines)


# --- run --------------------------------------------------------------------------------------------------------
def concurrency_levels(spec: str) -> list[int]:
    """ "1:4" -> [1, 2, 3, 4]; "1:16:5" -> [1, 6, 11, 16]; "4" -> [4]."""
    parts = [int(p) for p in spec.split(":")]
    start, end, step = parts[0], parts[1] if len(parts) > 1 else parts[0], parts[2] if len(parts) > 2 else 1
    if start < 1 or end < start or step < 1:
        raise ValueError(f"bad concurrency range {spec!r}")
    return list(range(start, end + 1, step))


def _run_level(cmd: list[str], env: dict, level: int, profile_path: Path, out_dir: Path, timeout_s) -> dict:
    """One level's run and its profile export. perf_analyzer 2.51 has exited 0 with its measurement printed and
    the export left empty (in CI runs): such a level is run again, once, after removing the empty export (it
    refuses a path that exists)."""
    for attempt in (1, 2):
        if attempt == 2:
            profile_path.unlink(missing_ok=True)
        print("[perf_analyzer]", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        (out_dir / f"perf_analyzer_c{level}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            out = proc.stdout + proc.stderr  # its reason comes first, then pages of usage
            raise RuntimeError(
                f"perf_analyzer failed ({proc.returncode}) at concurrency {level}:\n{out[:1500]}"
                + (f"\n...\n{out[-1500:]}" if len(out) > 3000 else out[1500:])
            )
        try:
            return json.loads(profile_path.read_text())
        except (OSError, ValueError) as e:
            problem = (
                f"perf_analyzer exited 0 at concurrency {level} but its profile export {profile_path} "
                f"is unreadable ({e})"
            )
            if attempt == 2:
                raise RuntimeError(problem + ", twice") from e
            print(f"[perf_analyzer] {problem}: running the level again", flush=True)
    raise AssertionError("unreachable")


def run_sweep(
    url: str,
    model: str,
    concurrency: str,
    input_json: Path,
    out_dir: Path,
    install_dir: Path,
    request_count: int,
    extra: list[str] | None = None,
    timeout_s: float | None = None,
) -> list[LevelSummary]:
    """One perf_analyzer run per level: 2.51 refuses --request-count with a concurrency range, and a fixed
    request count keeps a short sweep short and comparable."""
    binary, env = ensure_perf_analyzer(install_dir)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = []
    for level in concurrency_levels(concurrency):
        profile_path = out_dir / f"profile_export_c{level}.json"
        cmd = [
            str(binary),
            "-m",
            model,
            "-u",
            url,
            "-i",
            "grpc",
            "--streaming",
            "--input-data",
            str(input_json),
            "--concurrency-range",
            str(level),
            "--profile-export-file",
            str(profile_path),
            "-f",
            str(out_dir / f"perf_analyzer_c{level}.csv"),
            *(["--request-count", str(max(request_count, level))] if request_count else []),
            *(extra or []),
        ]
        levels.extend(summarize(_run_level(cmd, env, level, profile_path, out_dir, timeout_s)))
    (out_dir / "summary.json").write_text(json.dumps([asdict(lv) for lv in levels], indent=1))
    return levels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.perf_analyzer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="localhost:8001", help="the server's gRPC endpoint")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", default="1:4", help="start:end[:step]")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-count", type=int, default=16, help="requests per concurrency level (0: PA windows)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "build" / "perf")
    ap.add_argument("--install-dir", type=Path, default=ROOT / "build" / "perf_analyzer")
    ap.add_argument("extra", nargs="*", help="after --: passed to perf_analyzer")
    args = ap.parse_args(argv)
    prompts = corpus_prompts(args.corpus, args.prompts, args.prompt_words)
    input_json = write_input_json(prompts, args.max_tokens, args.out_dir / "inputs.json")
    levels = run_sweep(
        args.url,
        args.model,
        args.concurrency,
        input_json,
        args.out_dir,
        args.install_dir,
        args.request_count,
        args.extra,
    )
    print(format_table(levels))
    print(f"[perf_analyzer] raw output (csv, profile exports, logs) in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
