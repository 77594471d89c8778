"""Traffic kinds (tools/capacity/traffic.py): the rate scale sets the speed of one fixed set of requests."""

import pytest

from tools.capacity.traffic import KINDS, kinds
from tools.replay.paths import repo_path


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    k = KINDS[request.param]
    if not repo_path(k.trace).exists():
        pytest.skip(f"{k.trace} not present")
    return k


def test_rate_scale_changes_only_the_spacing(kind):
    slow, s1 = kind.requests(kind.start_rate_scale, 0)
    fast, s2 = kind.requests(2 * kind.start_rate_scale, 0)
    assert len(slow) >= kind.min_requests
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [(r.prompt_tokens, r.output_tokens) for r in fast]
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 2)
    assert s2.duration_s == pytest.approx(s1.duration_s / 2)
    assert f"time x{2 * kind.start_rate_scale / kind.thin:g}" in s2.describe()  # the scaling is printed


def test_seeds_thin_differently(kind):
    a, _ = kind.requests(kind.start_rate_scale, 0)
    b, _ = kind.requests(kind.start_rate_scale, 1)
    assert a != b


def test_every_request_fits_its_bound(kind):
    reqs, _ = kind.requests(kind.start_rate_scale, 0)
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) <= kind.max_tokens()
    # the short kinds fit the smallest pool mapped; conv-kv's requests hold real KV (docs/benchmarks.md), and a
    # chat turn its conversation so far
    bound = 1040 if kind.conversations else 640 if kind.name.startswith("conv-kv") else 256
    assert kind.max_tokens() <= bound


def test_conv_kv_requests_hold_real_kv():
    kind = KINDS["conv-kv"]
    if not repo_path(kind.trace).exists():
        pytest.skip(f"{kind.trace} not present")
    reqs, _ = kind.requests(kind.start_rate_scale, 0)
    held = sorted(r.prompt_tokens + r.output_tokens for r in reqs)
    outputs = sorted(r.output_tokens for r in reqs)
    assert outputs[len(outputs) // 2] >= 90  # the trace's outputs at most halved
    assert 150 <= held[len(held) // 2] <= 400


def test_a_variant_is_named_apart_and_checked(kind):
    v = kind.variant(kind.thin / 2, 50)
    assert v.name != kind.name and v.thin == kind.thin / 2
    with pytest.raises(ValueError, match="fewer than"):
        kind.variant(kind.thin / 100, 200).requests(kind.start_rate_scale, 0)


def test_unknown_kind_and_bad_rate():
    with pytest.raises(ValueError, match="unknown traffic kind 'chat'"):
        kinds("conv,chat")
    with pytest.raises(ValueError, match="rate scale must be > 0"):
        KINDS["conv"].shaping(0.0, 0)


def test_the_hour_keeps_the_traces_rate_swings():
    kind = KINDS["conv-kv-hour"]
    if not repo_path(kind.trace).exists():
        pytest.skip(f"{kind.trace} not present")
    window = KINDS["conv-kv"]
    same = ("prompt_scale", "prompt_clip", "output_scale", "output_clip")
    assert [getattr(kind, f) for f in same] == [getattr(window, f) for f in same]  # conv-kv's requests, longer
    reqs, shaping = kind.requests(kind.start_rate_scale, 0)
    held = sorted(r.prompt_tokens + r.output_tokens for r in reqs)
    assert 150 <= held[len(held) // 2] <= 400 and len(reqs) >= 200
    minute = shaping.duration_s / 58.5  # one trace minute, played faster
    per = [0] * 59
    for r in reqs:
        per[min(58, int(r.arrival_s // minute))] += 1
    busiest = sum(per[26:36]) / 10
    quietest = sum(per[47:57]) / 10
    assert busiest >= 1.5 * quietest  # the peak survives the thinning (trace: ~455 vs ~250 a minute)
