"""genai-perf (`--backend tensorrtllm`, the Triton kserve endpoint, --streaming) against a real tritonserver
serving the model: the run completes, every request streams the tokens it forced, and the prompt lengths its
tokenizer counted are the server's. genai-perf lives in its own virtualenv (`make
.venv-genaiperf/bin/genai-perf`, which `make test` runs): its pins are not ours. It drives the perf_analyzer
of build/perf_analyzer (tools/perf_analyzer.py installs it), found on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from tests import ROOT

pytestmark = [pytest.mark.needs_model, pytest.mark.server]
GENAI_PERF = ROOT / ".venv-genaiperf" / "bin" / "genai-perf"
FRAGMENTS = ROOT / "model_repository" / "smollm2" / "1" / "fragments"
MODEL = "smollm2"
REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 4, 2, 32, 16


def test_genai_perf_profiles_the_tensorrtllm_interface(triton_server, tmp_path):
    if not GENAI_PERF.exists():
        pytest.skip("genai-perf is not installed: `make .venv-genaiperf/bin/genai-perf` (make test does it)")
    from tools.perf_analyzer import ensure_perf_analyzer

    binary, env = ensure_perf_analyzer(ROOT / "build" / "perf_analyzer")
    env["PATH"] = os.pathsep.join([str(binary.parent), env.get("PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"  # the tokenizer is the model's own file, never one from the hub
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tokenizer = tmp_path / "tokenizer"  # genai-perf builds its prompts and counts tokens with it
    tokenizer.mkdir()
    shutil.copy(FRAGMENTS / "tokenizer.json", tokenizer / "tokenizer.json")
    # --output-tokens-mean-deterministic sends min_length = max_tokens, so every request streams exactly 16.
    cmd = [
        str(GENAI_PERF),
        "profile",
        "-m",
        MODEL,
        "--backend",
        "tensorrtllm",
        "--endpoint-type",
        "kserve",
        "--streaming",
        "-u",
        triton_server.grpc_url,
        "--tokenizer",
        str(tokenizer),
        "--concurrency",
        str(CONCURRENCY),
        "--request-count",
        str(REQUESTS),
        "--warmup-request-count",
        "0",
        "--synthetic-input-tokens-mean",
        str(INPUT_TOKENS),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(OUTPUT_TOKENS),
        "--output-tokens-mean-deterministic",
        "--random-seed",
        "0",
    ]
    for attempt in (1, 2):
        artifacts = tmp_path / f"artifacts{attempt}"
        run = subprocess.run(
            [*cmd, "--artifact-dir", str(artifacts)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
        )
        # perf_analyzer 2.51 has exited 0 with its export left empty under load (tools/perf_analyzer.py retries
        # such a level too); genai-perf then fails to parse it. That, and only that, is run again once.
        exports = list(artifacts.glob("*/profile_export.json"))
        if run.returncode == 0 or attempt == 2 or not exports or exports[0].stat().st_size:
            break
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (run_dir,) = [p for p in artifacts.iterdir() if p.is_dir()]  # <model>-triton-tensorrtllm-concurrency2
    sent = json.loads((run_dir / "inputs.json").read_text())["data"]
    assert all(r["max_tokens"] == r["min_length"] == [OUTPUT_TOKENS] and r["stream"] == [True] for r in sent)

    # perf_analyzer's raw export: every request answered, one token a response, ended by its length.
    (experiment,) = json.loads((run_dir / "profile_export.json").read_text())["experiments"]
    requests = experiment["requests"]
    assert experiment["experiment"] == {"mode": "concurrency", "value": CONCURRENCY}
    assert len(requests) == REQUESTS
    for r in requests:
        outputs = r["response_outputs"]
        assert len(r["response_timestamps"]) == len(outputs) == OUTPUT_TOKENS
        assert [o["output_token_count"] for o in outputs] == [1] * OUTPUT_TOKENS
        assert all(o["text_output"] for o in outputs)
        assert [o["finish_reason"] for o in outputs] == [""] * (OUTPUT_TOKENS - 1) + ["length"]
        assert {o["prompt_token_count"] for o in outputs} == {INPUT_TOKENS}  # the server counts what genai-perf did

    # genai-perf's own summary.
    summary = json.loads((run_dir / "profile_export_genai_perf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS
    isl = summary["input_sequence_length"]
    assert isl["min"] == isl["max"] == INPUT_TOKENS
    # genai-perf re-tokenizes the streamed text, which may merge a token pair differently than the model did.
    osl = summary["output_sequence_length"]
    assert OUTPUT_TOKENS - 2 <= osl["min"] <= osl["max"] <= OUTPUT_TOKENS + 2, osl
    ttft, latency, itl = summary["time_to_first_token"], summary["request_latency"], summary["inter_token_latency"]
    assert 0 < ttft["min"] <= ttft["max"] < latency["max"]
    assert ttft["avg"] < latency["avg"] and itl["avg"] > 0
    assert summary["output_token_throughput"]["avg"] > 0 and summary["request_throughput"]["avg"] > 0
    csv = (run_dir / "profile_export_genai_perf.csv").read_text()
    assert f"Request Count (count),{REQUESTS:.2f}" in csv
