"""Replay metrics on hand-made timelines with known answers (vLLM definitions), plus the metrics scrape and
the quality table reader."""

from __future__ import annotations

import json
import math

import pytest

from tools.replay import metrics as rm
from tools.replay.client import RequestRecord
from tools.replay.quality import load_quality
from tools.replay.sampler import snapshot


def rec(index, send, tokens, status="ok", end=None, int4=None, chunks=None, prompt=10):
    r = RequestRecord(index, send, prompt, len(tokens), send_s=send, status=status)
    r.token_s = list(tokens)
    r.chunk_s = list(chunks if chunks is not None else dict.fromkeys(tokens))
    r.first_token_s = tokens[0] if tokens else None
    r.end_s = end if end is not None else (tokens[-1] if tokens else send)
    r.int4_layers = list(int4 if int4 is not None else [0] * len(tokens))
    return r


@pytest.fixture
def timeline():
    return [
        rec(0, 0.0, [0.5, 0.6, 0.7, 0.8], int4=[0, 0, 4, 4]),  # TTFT 0.5, TPOT 0.1, E2EL 0.8
        rec(1, 1.0, [3.0, 3.2], int4=[10, 10]),  # TTFT 2.0 (over a 1 s SLO), TPOT 0.2
        rec(2, 2.0, [2.3]),  # one token: no TPOT
        rec(3, 2.5, [], status="rejected"),  # queue full
        rec(4, 3.0, [9.0], status="unfinished", end=10.0),  # cancelled at the end of the drain
    ]


def test_per_request_definitions(timeline):
    r0, r1, r2 = timeline[:3]
    assert rm.ttft(r0) == pytest.approx(0.5) and rm.e2el(r0) == pytest.approx(0.8)
    assert rm.tpot(r0) == pytest.approx(0.1) and rm.tpot(r1) == pytest.approx(0.2)
    assert rm.tpot(r2) is None and rm.tpot(timeline[4]) is None  # one token / not completed
    assert rm.itls(r0) == pytest.approx([0.1, 0.1, 0.1])
    assert rm.ttft(timeline[3]) is None


def test_itl_is_per_response_not_per_token():
    # Two tokens in one response (t=1.0), then one at t=1.5: one gap of 0.5; TPOT spreads E2EL over tokens.
    r = rec(0, 0.0, [1.0, 1.0, 1.5], chunks=[1.0, 1.5])
    assert rm.itls(r) == pytest.approx([0.5])
    assert rm.tpot(r) == pytest.approx(0.25)


def test_summary_with_slo(timeline):
    s = rm.summarize(timeline, rm.Slo(ttft_s=1.0))
    assert (s.requests, s.completed, s.rejected, s.failed) == (5, 3, 1, 1)
    assert s.duration_s == pytest.approx(10.0)  # first send 0.0 to last end 10.0
    assert s.request_throughput == pytest.approx(0.3)
    assert s.output_tokens == 7 and s.output_throughput == pytest.approx(0.7)
    assert s.total_token_throughput == pytest.approx((7 + 30) / 10)
    # Violations: r1 (TTFT 2.0), the rejected one and the unfinished one.
    assert s.slo_violation_rate == pytest.approx(3 / 5)
    assert s.goodput == pytest.approx(2 / 10)
    # TTFT includes the unfinished request's first token (6.0 s): 0.3, 0.5, 2.0, 6.0.
    assert s.ttft.n == 4 and s.ttft.mean == pytest.approx((0.5 + 2.0 + 0.3 + 6.0) / 4)
    assert s.ttft.p50 == pytest.approx(1.25)
    assert s.ttft.p99 == pytest.approx(2.0 + 0.97 * (6.0 - 2.0))  # linear interpolation, as numpy/vLLM
    assert s.tpot.n == 2 and s.tpot.mean == pytest.approx(0.15)
    assert s.itl.mean == pytest.approx((0.1 * 3 + 0.2) / 4)
    assert s.e2el.p50 == pytest.approx(0.8)  # E2EL 0.8, 2.2, 0.3


def test_tpot_slo_and_default_ttft_slo(timeline):
    strict = rm.summarize(timeline[:3], rm.Slo(ttft_s=5.0, tpot_s=0.15))
    assert strict.slo_violation_rate == pytest.approx(1 / 3)  # only r1's TPOT 0.2 breaks it
    assert rm.default_ttft_slo([0.1, 0.2, 0.3], 5.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rm.default_ttft_slo([])


def test_precision_and_quality(timeline):
    s = rm.summarize(timeline, rm.Slo(1.0))
    assert s.mean_int4_layers == pytest.approx(28 / 7)
    assert s.full_precision_share == pytest.approx(3 / 7)
    table = {0: 10.0, 4: 11.0, 10: 13.0}
    ppl = rm.weighted_perplexity(timeline, table)
    assert ppl == pytest.approx(78 / 7)  # tokens of the unfinished request are not counted
    assert rm.quality_loss(ppl, table) == pytest.approx(78 / 70 - 1)
    with pytest.raises(KeyError):
        rm.weighted_perplexity(timeline, {0: 10.0})


def test_empty_and_saturation():
    s = rm.summarize([], rm.Slo(1.0))
    assert s.requests == 0 and math.isnan(s.slo_violation_rate) and math.isnan(s.ttft.p95)
    pts = [(0.5, 0.0), (1.0, 0.05), (2.0, 0.3), (3.0, 0.05)]
    assert rm.max_sustained_rate(pts, 0.10) == 1.0  # 3.0 passing by chance does not count past a failure
    assert rm.max_sustained_rate([(1.0, 0.5)], 0.10) is None
    assert rm.max_sustained_rate([(1.0, math.nan)], 0.10) is None


def test_prometheus_snapshot():
    text = """# HELP morphserve_requests Requests by state
# TYPE morphserve_requests gauge
morphserve_requests{model="smollm2",state="waiting",version="1"} 3
morphserve_requests{model="smollm2",state="scheduled",version="1"} 5
morphserve_requests{model="other",state="waiting",version="1"} 99
morphserve_int4_layers{model="smollm2",version="1"} 8
morphserve_kv_cache_blocks{model="smollm2",type="max",version="1"} 256
morphserve_kv_cache_blocks{model="smollm2",type="used",version="1"} 200
morphserve_kv_capacity_blocks{model="smollm2",version="1"} 128
nv_inference_count{model="smollm2",version="1"} 7
"""
    snap = snapshot(text, model="smollm2")
    assert snap == {
        "waiting": 3,
        "scheduled": 5,
        "int4_layers": 8,
        "kv_blocks": 256,
        "kv_used": 200,
        "kv_capacity": 128,
    }


@pytest.mark.parametrize(
    "layout",
    [
        # python -m tools.eval_quality: the serving order's curve at every k, other orders at a few k.
        {
            "full_precision_ppl": 10.0,
            "by_order": {"front-to-back": {"0": 10.0, "2": 12.0}, "LIS": {"0": 10.0, "2": 11.0}},
            "serving_curve": {"0": 10.0, "1": 10.5, "2": 11.0},
        },
        {"orders": {"lis": [10.0, 10.5, 11.0]}},
        {"lis": {"0": 10.0, "1": 10.5, "2": 11.0}, "front_to_back": {"0": 10.0, "1": 12.0}},
        {"orders": {"lis": [{"k": 0, "perplexity": 10.0}, {"k": 1, "perplexity": 10.5}, {"k": 2, "perplexity": 11.0}]}},
        [
            {"order": "lis", "k": 0, "ppl": 10.0},
            {"order": "lis", "k": 1, "ppl": 10.5},
            {"order": "lis", "k": 2, "ppl": 11.0},
            {"order": "random", "k": 1, "ppl": 50.0},
        ],
    ],
)
def test_quality_table_layouts(tmp_path, layout):
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(layout))
    table, note = load_quality(path, "lis")
    assert table == {0: 10.0, 1: 10.5, 2: 11.0}, note


def test_quality_sparse_order_is_interpolated(tmp_path):
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"by_order": {"front-to-back": {"0": 10.0, "4": 12.0, "8": 20.0}}}))
    table, note = load_quality(path, "Front-to-Back")
    assert table == pytest.approx({0: 10.0, 1: 10.5, 2: 11.0, 3: 11.5, 4: 12.0, 5: 14.0, 6: 16.0, 7: 18.0, 8: 20.0})
    assert "6 k interpolated" in note


def test_quality_table_missing(tmp_path):
    table, note = load_quality(tmp_path / "nope.json")
    assert table is None and "n/a" in note
    (tmp_path / "q.json").write_text(json.dumps({"orders": {"random": [1.0, 2.0]}}))
    assert load_quality(tmp_path / "q.json", "lis")[0] is None
