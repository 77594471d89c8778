"""NVIDIA AIPerf (the successor of genai-perf) against the OpenAI gateway in front of a real tritonserver: the
benchmark completes with no error, and the token counts it reads from the server agree with the lengths it
forced. AIPerf lives in its own virtualenv (`make .venv-aiperf/bin/aiperf`, which `make test` runs): its pins are not ours."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from tests import ROOT
from tests.openai.test_openai_server import FRAGMENTS, KEY, MODEL, gateway  # noqa: F401

pytestmark = [pytest.mark.needs_model, pytest.mark.server]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
REQUESTS, CONCURRENCY, OUTPUT_TOKENS = 8, 4, 16


def test_aiperf_profiles_the_openai_endpoint(gateway, tmp_path):  # noqa: F811
    if not AIPERF.exists():
        pytest.skip("AIPerf is not installed: `make .venv-aiperf/bin/aiperf` (make test does it)")
    tokenizer = tmp_path / "tokenizer"  # AIPerf counts tokens itself, with the model's own tokenizer
    tokenizer.mkdir()
    shutil.copy(FRAGMENTS / "tokenizer.json", tokenizer / "tokenizer.json")
    artifacts = tmp_path / "artifacts"
    cmd = [
        str(AIPERF),
        "profile",
        "-m",
        MODEL,
        "--url",
        gateway.url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--api-key",
        KEY,
        "--tokenizer",
        str(tokenizer),
        "--concurrency",
        str(CONCURRENCY),
        "--request-count",
        str(REQUESTS),
        "--synthetic-input-tokens-mean",
        "48",
        "--output-tokens-mean",
        str(OUTPUT_TOKENS),
        "--extra-inputs",
        "ignore_eos:true",
        "--random-seed",
        "0",
        "--ui-type",
        "none",
        "--no-auto-plot",
        "--artifact-dir",
        str(artifacts),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] and not summary["was_cancelled"]
    assert summary["error_summary"] == [], summary["error_summary"]
    assert summary["request_count"]["avg"] == REQUESTS
    completion = summary["usage_completion_tokens"]  # the usage our server reported, every request
    assert (completion["count"], completion["min"], completion["max"]) == (REQUESTS, OUTPUT_TOKENS, OUTPUT_TOKENS)
    assert summary["time_to_first_token"]["count"] == REQUESTS
