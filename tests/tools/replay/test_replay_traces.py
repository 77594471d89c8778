"""Trace readers (Azure 2023 CSV, Mooncake-style JSONL), windowing, rate/time/length scaling, synthetic
arrivals, and prompts cut to an exact token length."""

from __future__ import annotations

import json
import statistics

import pytest

from tools.replay.paths import repo_path
from tools.replay.traces import Shaping, Synthetic, TraceRequest, parse_clip, read_trace

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.4799600,110,27
2023-11-16 18:17:13.9799600,7433,14
2023-11-16 18:17:10.9799600,1000,200
"""


@pytest.fixture
def azure(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(AZURE)
    return path


def test_azure_csv(azure):
    t = read_trace(azure)
    assert [r.arrival_s for r in t] == pytest.approx([0.0, 0.052, 1.5, 7.0, 10.0])  # sorted, from the first
    assert (t[0].prompt_tokens, t[0].output_tokens) == (4808, 10)
    assert (t[3].prompt_tokens, t[3].output_tokens) == (1000, 200)


def test_mooncake_jsonl(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 5000, "input_length": 700, "output_length": 30, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 6955, "output_length": 52, "hash_ids": [3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = read_trace(path)  # format from the extension; Mooncake timestamps are milliseconds
    assert t == [TraceRequest(0.0, 6955, 52), TraceRequest(3.0, 700, 30)]
    assert read_trace(path, "jsonl", jsonl_time_unit_s=1.0)[1].arrival_s == pytest.approx(3000.0)
    with pytest.raises(ValueError):
        read_trace(path, "parquet")


def test_window_is_relative_and_half_open(azure):
    t = read_trace(azure)
    w = Shaping(window_start_s=1.0, window_s=9.0).apply(t)  # [1, 10): drops 0.0, 0.052 and 10.0
    assert [r.arrival_s for r in w] == pytest.approx([0.5, 6.0])
    assert Shaping(window_start_s=1.0).apply(t)[-1].arrival_s == pytest.approx(9.0)  # to the end


def test_length_scale_and_clip(azure):
    s = Shaping(prompt_scale=0.1, output_scale=2.0, prompt_clip=(64, 500), output_clip=(16, 100))
    out = s.apply(read_trace(azure))
    assert [r.prompt_tokens for r in out] == [481, 318, 64, 100, 500]  # 480.8, 318, 11->64, 100, 743->500
    assert [r.output_tokens for r in out] == [20, 16, 54, 100, 28]  # 20, 16, 54, 400->100, 28
    text = s.describe()
    assert "x0.1" in text and "64:500" in text and "16:100" in text and "5 requests" in text


def test_time_scale(azure):
    out = Shaping(window_s=12.0, time_scale=2.0).apply(read_trace(azure))
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 0.026, 0.75, 3.5, 5.0])
    assert Shaping(window_s=12.0, time_scale=2.0).duration_s == 6.0


def _many(n=2000, span=100.0):
    return [TraceRequest(i * span / n, 100, 10) for i in range(n)]


def test_rate_scale_thins_and_replicates_deterministically():
    trace = _many()
    half = Shaping(rate_scale=0.5, seed=3).apply(trace)
    assert 900 < len(half) < 1100
    assert half == Shaping(rate_scale=0.5, seed=3).apply(trace)  # same seed, same requests
    assert len(Shaping(rate_scale=3.0).apply(trace)) == 6000
    double = Shaping(rate_scale=2.0).apply(trace)
    assert len(double) == 4000
    assert all(0 <= b.arrival_s - a.arrival_s < 1.0 + 1e-9 for a, b in zip(trace, double[::2]))  # replicas nearby
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(double, double[1:]))


def test_rate_scales_are_nested():
    """A sweep compares like with like: what x0.3 keeps, x0.6 keeps too."""
    trace = _many()
    low = {(r.arrival_s, r.prompt_tokens) for r in Shaping(rate_scale=0.3).apply(trace)}
    high = {(r.arrival_s, r.prompt_tokens) for r in Shaping(rate_scale=0.6).apply(trace)}
    assert low < high


def test_bad_shaping():
    with pytest.raises(ValueError):
        Shaping(rate_scale=0)
    with pytest.raises(ValueError):
        Shaping(prompt_clip=(100, 10))
    assert parse_clip("64:768") == (64, 768) and parse_clip("16:") == (16, None) and parse_clip(":5") == (1, 5)
    with pytest.raises(ValueError):
        parse_clip("64")


def test_synthetic_poisson_and_gamma():
    p = Synthetic("poisson", rate=5.0, duration_s=200.0, seed=1).generate()
    assert 900 < len(p) < 1100 and all(0 <= r.arrival_s < 200 for r in p)
    gaps = lambda t: [b.arrival_s - a.arrival_s for a, b in zip(t, t[1:])]  # noqa: E731
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    assert 0.85 < cv(gaps(p)) < 1.15  # exponential gaps
    bursty = Synthetic("gamma", rate=5.0, duration_s=200.0, burstiness=0.25, seed=1).generate()
    assert 800 < len(bursty) < 1200 and cv(gaps(bursty)) > 1.5
    jit = Synthetic("poisson", rate=5.0, duration_s=20.0, prompt_tokens=100, length_jitter=0.2).generate()
    assert all(80 <= r.prompt_tokens <= 120 for r in jit) and len({r.prompt_tokens for r in jit}) > 5


def test_synthetic_step_bursts():
    s = Synthetic("step", rate=0.0, burst_rate=10.0, burst_s=5.0, period_s=20.0, duration_s=100.0, seed=2)
    t = s.generate()
    assert all(r.arrival_s % 20.0 < 5.0 for r in t)  # nothing between bursts
    assert 200 < len(t) < 300  # 5 bursts x 5 s x 10 req/s
    with pytest.raises(ValueError):
        Synthetic("step", burst_s=30.0, period_s=20.0)


@pytest.mark.needs_model
def test_prompts_have_the_requested_token_length():
    from tools.replay.prompts import DEFAULT_CORPUS, DEFAULT_FRAGMENTS, PromptSource, load_tokenizer

    if not repo_path(DEFAULT_CORPUS).exists() or not (repo_path(DEFAULT_FRAGMENTS) / "manifest.json").exists():
        pytest.skip("corpus or fragment set missing")
    tok = load_tokenizer()
    src = PromptSource(tok, max_chars=200_000)
    for i, n in enumerate([1, 17, 128, 700]):
        text, got = src.prompt(i, n)
        assert got == n and len(tok.encode(text)) == n
    assert src.prompt(0, 64)[0] != src.prompt(1, 64)[0]  # different offsets, no shared prefix


def test_default_window_of_the_azure_code_trace_is_bursty():
    from tools.replay.settings import DEFAULT_WORKLOAD as d

    path = repo_path("../shared/data/traces/azure_llm_code_2023.csv")
    if not path.exists():
        pytest.skip("Azure trace not present")

    trace = read_trace(path)
    assert len(trace) > 8000
    window = Shaping(d["window_start"], d["window"]).apply(trace)
    per_10s = [sum(1 for r in window if k * 10 <= r.arrival_s < (k + 1) * 10) for k in range(int(d["window"] // 10))]
    assert max(per_10s) > 5 * max(1, min(per_10s))  # bursts and lulls, not a steady stream
