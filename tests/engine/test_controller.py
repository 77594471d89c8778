"""The controller on synthetic signal traces: bursts swap quickly, quiet restores, steady load never flaps."""

import pytest

from trtllm_backend.controller import (
    TPOT_PRESSURE_SHARE,
    TTFT_PRESSURE_SHARE,
    Controller,
    Load,
    Signals,
    parse_forced,
    parse_policy,
)


def signals(t, waiting=0, blocked=False, usage=0.3, int4=0, after=0.2, preempt=0, head_wait=None, **more):
    """One iteration's Signals; `more`: tpot, faster (the next swap measured faster), miss (evicted-prefix prefill)."""
    head_wait = (1.0 if blocked else 0.0) if head_wait is None else head_wait
    return Signals(
        now=t,
        waiting=waiting,
        head_wait_s=head_wait,
        kv_usage=usage,
        admission_blocked=blocked,
        new_preemptions=preempt,
        queue_blocks_short=40 if blocked else 0,
        blocks_per_layer=16,
        int4_layers=int4,
        usage_after_shrink=after,
        tpot_s=more.pop("tpot", 0.0),
        swap_speeds_up=more.pop("faster", False),
        evicted_miss_s=more.pop("miss", 0.0),
        **more,  # anything else is a typo: Signals refuses it
    )


def run(controller, trace):
    """trace: list of signal kwargs, one per 50 ms iteration; applies actions to int4 like the manager."""
    int4, actions = 0, []
    for i, kw in enumerate(trace):
        a = controller.decide(signals(i * 0.05, int4=int4, **kw), i)
        if a:
            int4 += a.layers if a.kind == "down" else -a.layers
            actions.append((i, a.kind, a.layers))
    return int4, actions


def test_burst_swaps_within_a_few_iterations_enough_for_the_queue():
    c = Controller(parse_policy("balanced", 30))
    int4, actions = run(c, [dict()] * 5 + [dict(waiting=8, blocked=True, usage=0.97)] * 4)
    first = actions[0]
    assert first[1] == "down" and first[0] <= 5 + 2
    assert first[2] == 3  # ceil(40 short blocks / 16 per layer) beats the policy's step of 2


def test_swaps_that_follow_each_other_without_a_quiet_spell_grow():
    c = Controller(parse_policy("balanced", 30))
    short = dict(waiting=3, usage=0.95, head_wait=1.0)  # KV short, but the queue lacks no blocks: the step rules
    int4, actions = run(c, [short] * 12)
    assert [k for _, _, k in actions] == [2, 4, 8, 6]  # 2, 4, 8, then the 20-layer limit
    assert int4 == c.policy.max_int4_layers


def test_a_quiet_spell_or_a_restore_starts_the_step_over():
    c = Controller(parse_policy("balanced", 30))
    short = dict(waiting=3, usage=0.95, head_wait=1.0)
    quiet = [dict(usage=0.6, after=0.95)] * 50  # 2.5 s: longer than up_quiet_s, no restore (usage too high)
    _, actions = run(c, [short] * 5 + quiet + [short] * 3)
    assert [k for _, _, k in actions] == [2, 4, 2]
    c = Controller(parse_policy("balanced", 30))
    calm = [dict(usage=0.1, after=0.15)] * 45  # restores after 2 s, then pressure at once
    _, actions = run(c, [short] * 5 + calm + [short] * 3)
    assert [(kind, k) for _, kind, k in actions] == [("down", 2), ("down", 4), ("up", 2), ("down", 2)]


def test_a_growth_of_one_keeps_every_step_the_same():
    c = Controller(parse_policy("balanced", 30, {"down_step_growth": 1}))
    _, actions = run(c, [dict(waiting=3, usage=0.95, head_wait=1.0)] * 12)
    assert {k for _, _, k in actions} == {2}
    assert parse_policy("accuracy", 30).down_step_growth == 1.0  # the mode that morphs late and slowly


def test_quiet_period_restores_everything_last_in_first_out():
    c = Controller(parse_policy("balanced", 30))
    burst = [dict(waiting=8, blocked=True, usage=0.97)] * 6
    quiet = [dict(usage=0.1, after=0.15)] * 400  # 20 s
    int4, actions = run(c, burst + quiet)
    assert int4 == 0 and actions[-1][1] == "up"
    first_up = next(i for i, k, _ in actions if k == "up")
    assert (first_up - (len(burst) - 1)) * 0.05 >= c.policy.up_quiet_s - 1e-9  # quiet counted from the last pressure


def test_steady_load_near_the_threshold_does_not_oscillate():
    c = Controller(parse_policy("balanced", 30))
    # Usage hovers around the down threshold with nobody waiting: never pressure, never a restore either
    # because the KV left after a shrink would be above up_kv_usage.
    trace = [dict(usage=0.88 + 0.04 * (i % 2), after=0.95) for i in range(400)]
    int4, actions = run(c, [dict(waiting=8, blocked=True, usage=0.97)] * 3 + trace)
    kinds = [k for _, k, _ in actions]
    assert kinds.count("up") == 0 and kinds.count("down") == 1


def test_alternating_pressure_below_persistence_does_nothing():
    c = Controller(parse_policy("accuracy", 30))  # needs 4 consecutive pressured iterations
    trace = [dict(waiting=2, blocked=True) if i % 2 else dict() for i in range(200)]
    assert run(c, trace) == (0, [])


def test_static_policies_never_act_and_max_is_respected():
    assert run(Controller(parse_policy("full", 30)), [dict(waiting=9, blocked=True)] * 50) == (0, [])
    c = Controller(parse_policy("accuracy", 30))
    int4, _ = run(c, [dict(waiting=9, blocked=True, usage=0.99)] * 400)
    assert int4 == 10  # a third of the layers


@pytest.mark.parametrize(
    "spec, overrides, match",
    [
        ("fast", None, "morph_policy"),
        ("int4:x", None, "morph_policy"),
        ("int4:31", None, "morph_policy"),
        ("balanced", {"up_kv_usage": 0.95}, "morph_up_kv_usage"),
        ("balanced", {"layers_per_action": 0}, "morph_layers_per_action"),
        ("balanced", {"down_kv_usage": "high"}, "morph_down_kv_usage"),
        ("balanced", {"nope": 1}, "morph_nope"),
        ("balanced", {"down_tpot_s": -0.1}, "morph_down_tpot_s"),
        ("balanced", {"up_tpot_ratio": 1.0}, "morph_up_tpot_ratio"),
        ("balanced", {"down_step_growth": 0.5}, "morph_down_step_growth"),
        ("balanced", {"down_step_growth": "inf"}, "morph_down_step_growth"),
    ],
)
def test_invalid_policies_are_named(spec, overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec, 30, overrides)


def test_static_specs():
    assert parse_policy("int4", 30).static_int4_layers == 30
    assert parse_policy("int4:7", 30).static_int4_layers == 7
    assert parse_policy("full", 30).static_int4_layers == 0


def test_forced_actions_parse():
    f = parse_forced("down:3@5, up:2@40")
    assert (f[5].kind, f[5].layers, f[40].kind, f[40].layers) == ("down", 3, "up", 2)
    with pytest.raises(ValueError, match="MORPHSERVE_FORCE_MORPH"):
        parse_forced("sideways@3")


def test_a_queue_without_kv_shortage_is_not_pressure():
    """Requests wait because iterations are slow or the batch is full, with KV to spare: quantizing buys
    nothing, so the controller must not act (it used to swap down and up on every arrival)."""
    c = Controller(parse_policy("performance", 30))
    trace = [
        dict(waiting=3, usage=0.2, head_wait=0.6, after=0.25) if i % 10 < 3 else dict(usage=0.2, after=0.25)
        for i in range(400)
    ]
    assert run(c, trace) == (0, [])


def test_a_short_kv_wait_below_the_threshold_is_tolerated():
    c = Controller(parse_policy("balanced", 30))
    assert run(c, [dict(waiting=2, blocked=True, head_wait=0.1)] * 50) == (0, [])


# ---- decode time as pressure (morph_down_tpot_s) ---------------------------------------------------------------
SLO = {"down_tpot_s": 0.05}
SLOW = dict(waiting=3, tpot=0.08, faster=True)  # TPOT 80 ms over a 50 ms SLO, requests waiting, swap measured faster


def test_slow_decode_with_a_queue_swaps_where_quantized_is_faster():
    c = Controller(parse_policy("balanced", 31, SLO))
    int4, actions = run(c, [dict()] * 3 + [SLOW] * 3)
    assert actions[0] == (3 + c.policy.down_persist - 1, "down", c.policy.layers_per_action)  # the same persistence


@pytest.mark.parametrize("what", [dict(faster=False), dict(waiting=0), dict(tpot=0.04)])
def test_slow_decode_is_not_pressure_without_each_condition(what):
    c = Controller(parse_policy("balanced", 31, SLO))
    assert run(c, [{**SLOW, **what}] * 100) == (0, [])
    off = Controller(parse_policy("balanced", 31))  # without an SLO decode time is never pressure
    assert run(off, [SLOW] * 100) == (0, [])


def test_the_tpot_slo_sets_the_decode_time_pressure_of_dynamic_policies_only():
    for name in ("accuracy", "balanced", "performance"):
        assert parse_policy(name, 31, tpot_slo_s=0.35).down_tpot_s == pytest.approx(TPOT_PRESSURE_SHARE * 0.35)
        assert parse_policy(name, 31, tpot_slo_s=0.0).down_tpot_s == 0.0  # no SLO: KV pressure only
    for name in ("full", "int4", "int4:5"):
        assert parse_policy(name, 31, tpot_slo_s=0.35).down_tpot_s == 0.0
    # an explicit threshold wins over the SLO's, 0 included (the pressure off under an SLO)
    assert parse_policy("balanced", 31, {"down_tpot_s": 0.2}, tpot_slo_s=0.35).down_tpot_s == 0.2
    assert parse_policy("balanced", 31, {"down_tpot_s": 0}, tpot_slo_s=0.35).down_tpot_s == 0.0
    c = Controller(parse_policy("balanced", 31, tpot_slo_s=0.07))  # 59.5 ms: SLOW's 80 ms TPOT is pressure
    assert run(c, [SLOW] * 3)[0] == c.policy.layers_per_action


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_a_bad_tpot_slo_is_named(bad):
    with pytest.raises(ValueError, match="tpot_slo_s"):
        parse_policy("balanced", 31, tpot_slo_s=bad)


def test_restore_waits_for_tpot_well_below_the_slo():
    c = Controller(parse_policy("balanced", 31, SLO))
    near = [dict(tpot=0.045)] * 200  # quiet, below the SLO, but above up_tpot_ratio * SLO (35 ms): stays morphed
    int4, actions = run(c, [SLOW] * 2 + near)
    assert int4 == 2 and [k for _, k, _ in actions] == ["down"]
    c = Controller(parse_policy("balanced", 31, SLO))
    int4, actions = run(c, [SLOW] * 2 + [dict(tpot=0.03)] * 200)
    assert int4 == 0 and [k for _, k, _ in actions] == ["down", "up"]
    first_up = next(i for i, k, _ in actions if k == "up")
    assert (first_up - 1) * 0.05 >= c.policy.up_quiet_s - 1e-9


def test_tpot_hovering_at_the_slo_does_not_flap():
    c = Controller(parse_policy("balanced", 31, SLO))
    # TPOT alternates just above and below the SLO with a queue: pressure never persists two iterations in a row
    trace = [dict(waiting=2, tpot=0.051 if i % 2 else 0.049, faster=True) for i in range(400)]
    assert run(c, trace) == (0, [])


def test_quiet_spell_counts_from_the_end_of_an_action_in_flight():
    """A swap down whose staging outlasts up_quiet_s must not be undone the moment it lands: the iterations the
    manager spends on it (`hold`) restart the quiet spell, and pressure seen meanwhile counts as pressure."""
    c = Controller(parse_policy("balanced", 30))
    t = 0.0
    for i in range(2):  # a burst: the swap down is decided at the second pressured iteration
        a = c.decide(signals(t, waiting=8, blocked=True, usage=0.97), i)
        t += 0.05
    assert a and a.kind == "down"
    for _ in range(60):  # 3 s of staging, longer than up_quiet_s, with the burst going on for the first second
        c.hold(signals(t, waiting=8 if t < 1.0 else 0, blocked=t < 1.0, usage=0.97 if t < 1.0 else 0.1, int4=2))
        t += 0.05
    landed = t
    restore_at = None
    for i in range(100):
        if c.decide(signals(t, usage=0.1, after=0.15, int4=2), 100 + i):
            restore_at = t
            break
        t += 0.05
    assert restore_at is not None and restore_at - landed >= c.policy.up_quiet_s - 1e-9


# ---- queueing as pressure (morph_down_ttft_s) -----------------------------------------------------------------
QUEUE = {"down_ttft_s": 1.0}
QUEUED = dict(waiting=5, head_wait=1.5, usage=0.6, faster=True)  # waited 1.5 s, KV not short, swap measured faster


def test_a_queue_waiting_on_compute_swaps_where_quantized_is_faster():
    c = Controller(parse_policy("balanced", 31, QUEUE))
    int4, actions = run(c, [dict()] * 3 + [QUEUED] * 3)
    # at once (the head's wait is its own persistence), and again, growing, while it keeps waiting
    assert actions == [(3, "down", 2), (4, "down", 4), (5, "down", 8)]
    assert "KV cache not short" in c.pressure(signals(0.0, **QUEUED))[0]


@pytest.mark.parametrize("what", [dict(faster=False), dict(waiting=0), dict(head_wait=0.9)])
def test_queueing_is_not_pressure_without_each_condition(what):
    c = Controller(parse_policy("balanced", 31, QUEUE))
    assert run(c, [{**QUEUED, **what}] * 100) == (0, [])
    off = Controller(parse_policy("balanced", 31))  # without a TTFT SLO queueing is never pressure
    assert run(off, [QUEUED] * 100) == (0, [])


def test_a_queue_short_of_kv_is_named_once_as_kv_pressure():
    c = Controller(parse_policy("balanced", 31, QUEUE))
    why = c.pressure(signals(0.0, **{**QUEUED, "usage": 0.95}))
    assert len(why) == 1 and "for KV blocks" in why[0]


def test_the_ttft_slo_sets_the_queueing_pressure_of_the_capacity_first_mode_only():
    assert parse_policy("performance", 31, ttft_slo_s=2.0).down_ttft_s == pytest.approx(TTFT_PRESSURE_SHARE * 2.0)
    assert parse_policy("performance", 31, ttft_slo_s=0.0).down_ttft_s == 0.0
    for name in ("accuracy", "balanced", "full", "int4", "int4:5"):  # quality first, or static
        assert parse_policy(name, 31, ttft_slo_s=2.0).down_ttft_s == 0.0
    assert parse_policy("balanced", 31, {"down_ttft_s": 0}, ttft_slo_s=2.0).down_ttft_s == 0.0
    assert parse_policy("balanced", 31, {"down_ttft_s": 0.4}, ttft_slo_s=2.0).down_ttft_s == 0.4
    with pytest.raises(ValueError, match="ttft_slo_s"):
        parse_policy("balanced", 31, ttft_slo_s=-1.0)
    with pytest.raises(ValueError, match="morph_down_ttft_s"):
        parse_policy("balanced", 31, {"down_ttft_s": -0.5})


def test_a_drained_queue_restores_after_the_quiet_spell():
    c = Controller(parse_policy("balanced", 31, QUEUE))
    int4, actions = run(c, [QUEUED] * 2 + [dict(usage=0.3, after=0.3)] * 200)
    assert int4 == 0 and [(k, n) for _, k, n in actions] == [("down", 2), ("down", 4), ("up", 2), ("up", 2), ("up", 2)]
    first_up = next(i for i, k, _ in actions if k == "up")
    assert (first_up - 1) * 0.05 >= c.policy.up_quiet_s - 1e-9


def test_queueing_stops_at_the_policys_limit():
    c = Controller(parse_policy("balanced", 31, QUEUE))
    assert run(c, [QUEUED] * 100)[0] == c.policy.max_int4_layers


def test_signals_are_the_load_plus_the_managers_state():
    load = Load(
        now=3.0,
        waiting=4,
        head_wait_s=0.7,
        kv_usage=0.95,
        admission_blocked=True,
        new_preemptions=1,
        queue_blocks_short=40,
        tpot_s=0.02,
        batch=9,
        evicted_miss_s=0.3,
    )
    s = Signals.of(load, blocks_per_layer=16, int4_layers=2, usage_after_shrink=0.6, swap_speeds_up=True)
    assert s == Signals(
        now=3.0,
        waiting=4,
        head_wait_s=0.7,
        kv_usage=0.95,
        admission_blocked=True,
        new_preemptions=1,
        queue_blocks_short=40,
        blocks_per_layer=16,
        int4_layers=2,
        usage_after_shrink=0.6,
        tpot_s=0.02,
        swap_speeds_up=True,
        evicted_miss_s=0.3,
    )


def test_a_restore_called_off_restarts_the_quiet_spell():
    c = Controller(parse_policy("balanced", 30))
    quiet = dict(usage=0.1, after=0.15, int4=2)
    c.restore_called_off(10.0)
    assert c.decide(signals(10.0 + c.policy.up_quiet_s - 0.05, **quiet), 0) is None
    action = c.decide(signals(10.0 + c.policy.up_quiet_s, **quiet), 1)
    assert action is not None and action.kind == "up"


# ---- prefill on evicted prefix blocks as pressure (morph_down_cache_miss_s) ------------------------------------
CACHE = {"down_cache_miss_s": 0.5, "up_cache_quiet_s": 10.0}
MISSED = dict(miss=0.8)  # a returning turn re-prefilled 0.8 s of blocks the cache had evicted


def test_prefill_on_evicted_blocks_swaps_down_at_once():
    c = Controller(parse_policy("balanced", 30, CACHE))
    int4, actions = run(c, [dict()] * 3 + [MISSED] + [dict()] * 3)
    assert actions == [(3, "down", c.policy.layers_per_action)]  # an event: no streak to wait for
    assert "prefix cache had evicted" in c.pressure(signals(0.0, **MISSED))[0]


@pytest.mark.parametrize(
    "overrides, trace",
    [
        ({}, [MISSED] * 20),  # off by default
        (CACHE, [dict(miss=0.4)] * 20),  # below the threshold
    ],
)
def test_evicted_misses_are_not_pressure_when_off_or_small(overrides, trace):
    assert run(Controller(parse_policy("balanced", 30, overrides)), trace) == (0, [])


def test_restore_waits_for_the_cache_quiet_spell_not_the_burst_one():
    c = Controller(parse_policy("balanced", 30, CACHE))
    quiet = dict(usage=0.1, after=0.15)
    int4, actions = run(c, [MISSED] + [quiet] * 400)  # 20 s
    ups = [i for i, k, _ in actions if k == "up"]
    assert int4 == 0 and ups
    assert ups[0] * 0.05 >= CACHE["up_cache_quiet_s"] - 1e-9  # not after up_quiet_s (2 s)
    assert ups[0] * 0.05 < CACHE["up_cache_quiet_s"] + 1.0


def test_a_cache_miss_during_an_action_in_flight_restarts_the_cache_quiet_spell():
    c = Controller(parse_policy("balanced", 30, CACHE))
    c.hold(signals(5.0, int4=2, **MISSED))
    assert c.decide(signals(5.0 + CACHE["up_cache_quiet_s"] - 0.1, usage=0.1, after=0.15, int4=2), 1) is None
    a = c.decide(signals(5.0 + CACHE["up_cache_quiet_s"], usage=0.1, after=0.15, int4=2), 2)
    assert a and a.kind == "up"


def test_cache_thresholds_are_checked():
    with pytest.raises(ValueError, match="morph_down_cache_miss_s"):
        parse_policy("balanced", 30, {"down_cache_miss_s": -1})
    with pytest.raises(ValueError, match="morph_up_cache_quiet_s"):
        parse_policy("balanced", 30, {"up_cache_quiet_s": -1})
    assert parse_policy("balanced", 30, ttft_slo_s=2.0, tpot_slo_s=0.35).down_cache_miss_s == 0.0
