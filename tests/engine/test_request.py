"""A request's recent TPOT and the decode-time pressure signal taken from the running streams."""

import pytest
from tests.engine_fixtures import PROMPTS, make_engine

from trtllm_backend.outputs import RequestTimings
from trtllm_backend.request import RECENT_TPOT_TOKENS, Request, streams_tpot
from trtllm_backend.sampling import SamplingParams


def request_with_gaps(gaps: list[float], start: float = 100.0) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), RequestTimings(arrival=0.0))
    t = start
    r.note_token_time(t)
    for g in gaps:
        t += g
        r.note_token_time(t)
    return r


def test_no_recent_tpot_before_the_second_token():
    assert request_with_gaps([]).recent_tpot is None
    assert request_with_gaps([0.2]).recent_tpot == pytest.approx(0.2)


def test_recent_tpot_is_the_mean_gap_over_the_last_window_of_tokens():
    old = [5.0] * 4  # slow tokens long ago fall out of the window
    recent = [0.1] * (RECENT_TPOT_TOKENS - 1) + [0.4]
    assert request_with_gaps(old + recent).recent_tpot == pytest.approx(sum(recent) / RECENT_TPOT_TOKENS)


def test_one_step_that_also_prefills_does_not_read_as_slow_streams():
    # The old signal was an average of step times: steps carrying prefill chunks dominated it while requests
    # waited. A stream delayed once by such a step is a little slower on average, not slow.
    streams = [request_with_gaps([0.1] * 15 + [0.45]) for _ in range(3)]
    assert streams_tpot(streams) < 0.85 * 0.35
    # Sustained slowness is what the SLO judges, and it does read as pressure.
    assert streams_tpot([request_with_gaps([0.4] * 16) for _ in range(3)]) > 0.85 * 0.35


def test_streams_tpot_is_the_median_over_requests_with_two_tokens():
    assert streams_tpot([]) == 0.0
    assert streams_tpot([request_with_gaps([])]) == 0.0  # just prefilled: no gap yet
    rs = [request_with_gaps([g]) for g in (0.1, 0.2, 9.0)] + [request_with_gaps([])]
    assert streams_tpot(rs) == pytest.approx(0.2)  # one stalled stream does not decide


@pytest.mark.needs_model
@pytest.mark.needs_model
def test_engine_signal_is_what_the_running_streams_saw(monkeypatch):
    engine = make_engine(morph_policy="balanced")
    seen: list[tuple[float, float, list[int]]] = []
    on_iteration = engine.morph.on_iteration

    def record(signals, iteration, block_tables):
        running = engine.scheduler.running
        seen.append((signals.tpot_s, streams_tpot(running), [len(r.token_times) for r in running]))
        on_iteration(signals, iteration, block_tables)

    monkeypatch.setattr(engine.morph, "on_iteration", record)
    n = RECENT_TPOT_TOKENS + 4
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), lambda o: None, request_id=f"p{i}")
    engine.run_until_idle()
    assert all(sig == want for sig, want, _ in seen)
    assert seen[0][0] == 0.0  # nothing decoded yet
    assert any(sig > 0 for sig, _, _ in seen)
    # One time per emitted token, the window capped.
    assert max(max(counts, default=0) for _, _, counts in seen) == RECENT_TPOT_TOKENS + 1
