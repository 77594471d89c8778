"""Morphing on the real model: swaps and restores mid-generation, the memory budget, faults at swap time.

Needs the INT4 fragments that `make setup` builds (engines.quantize_awq).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests import ROOT
from tests.engine_fixtures import PROMPTS, damaged_fragment_copy, fragment_dir, make_engine

from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model


@pytest.fixture(autouse=True)
def need_int4():
    m = Manifest(fragment_dir())
    assert all(Precision.INT4 in m.precisions(i) for i in range(m.num_layers)), (
        "INT4 fragments missing: run `make setup`"
    )


def collect(engine, prompts, max_tokens):
    outs = {}
    for i, p in enumerate(prompts):
        outs[f"p{i}"] = []
        engine.add_request(
            p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), outs[f"p{i}"].append, request_id=f"p{i}"
        )
    engine.run_until_idle()
    return outs


def tokens_and_states(pieces):
    toks, states = [], []
    for o in pieces:
        toks += o.token_ids
        states += o.int4_layers
    return toks, states


def settle(engine):
    assert engine.settle_morph(timeout_s=120), "morphing did not settle"


def test_forced_swaps_and_restores_mid_generation():
    prompts = PROMPTS[:3]
    baseline = collect(make_engine(morph_policy="full"), prompts, 40)
    # Small base pool so the requests spill into the segments the swaps add (the restore must migrate them).
    # (the staging reserve, ~48 fp32 tokens, comes out of it)
    engine = make_engine(
        morph_policy="full", block_size=8, max_tokens_in_paged_kv_cache=144, force_morph="down:2@4,up:2@20"
    )
    base_blocks = engine.pool.num_blocks
    morphed = collect(engine, prompts, 40)
    settle(engine)
    c = engine.counters
    assert (c.swaps_down, c.swaps_up) == (2, 2) and c.kv_grows >= 2 and c.kv_shrinks == 2
    assert engine.scheduler.num_preemptions == 0
    assert c.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)  # nothing re-prefilled
    saw_int4 = False
    for rid, pieces in morphed.items():
        toks, states = tokens_and_states(pieces)
        base, _ = tokens_and_states(baseline[rid])
        assert len(toks) == 40 and pieces[-1].finish_reason == "length"
        first = next((i for i, s in enumerate(states) if s), len(states))
        saw_int4 |= first < len(states)
        assert toks[:first] == base[:first]  # identical until the first token made with INT4 layers
    assert saw_int4
    assert engine.num_quantized_layers() == 0 and engine.pool.num_used == 0
    assert engine.pool.num_blocks == base_blocks
    assert engine.morph.account.used <= engine.morph.account.budget
    timed, timings = engine.stats().swaps_timed, engine.stats().swap_timings
    assert timed == 4 and len(timings) == 4 and all(p > 0 and a > 0 for p, a in timings)  # each one timed


@pytest.mark.parametrize("weight_dtype", ["auto", "float16"])
def test_capacity_grows_by_exactly_the_freed_blocks(weight_dtype, layer_set):
    # fp16-stored full-precision layers free half as many bytes per swap; the account must follow either way.
    engine = make_engine(
        morph_policy="full",
        max_tokens_in_paged_kv_cache=512,
        weight_dtype=weight_dtype,
        force_morph="down:3@0",
        fragment_dir=str(layer_set),
    )
    m = engine.morph
    base_blocks, r0 = engine.pool.num_blocks, m.account.available
    full = m.full_bytes[0]
    assert engine.model.slots[0].weights.qkv.weight.element_size() == (2 if weight_dtype == "float16" else 4)
    engine.step()
    settle(engine)
    assert engine.num_quantized_layers() == 3
    int4 = sum(s.weights.nbytes for s in engine.model.slots if s.precision == Precision.INT4)
    freed = 3 * full - int4
    assert engine.pool.num_blocks - base_blocks == (freed + r0) // engine.pool.bytes_per_block
    assert m.account.used <= m.account.budget
    assert m.account.used == m.account.shared + m.account.layers + m.account.kv  # nothing staged, exact


def test_corrupt_int4_fragment_at_swap_time_keeps_serving(monkeypatch, tmp_path):
    dst, _ = damaged_fragment_copy(tmp_path / "fragments")
    monkeypatch.setenv("MORPHSERVE_FORCE_MORPH", "down:1@1")  # the environment hook, not EngineConfig.force_morph
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine

    engine = LLMEngine(EngineConfig(fragment_dir=str(dst), morph_policy="full"))
    outs = collect(engine, PROMPTS[:2], 12)
    settle(engine)
    assert engine.counters.swap_failures == 1 and engine.num_quantized_layers() == 0
    assert all(p[-1].finish_reason == "length" for p in outs.values())


def test_static_int4_policy_serves_with_more_kv():
    full = make_engine(morph_policy="full")
    quant = make_engine(morph_policy="int4")
    assert quant.num_quantized_layers() == 30
    assert quant.pool.num_blocks > full.pool.num_blocks * 1.3
    outs = list(quant.generate("The capital of France is", SamplingParams(max_tokens=6)))
    assert all(s == 30 for o in outs for s in o.int4_layers)


def test_peak_rss_stays_within_budget_plus_fixed_overhead():
    """In a fresh process. Fixed overhead = RSS right after load, every accounted byte resident, minus the
    accounted bytes (interpreter, libraries, tokenizer, RoPE tables); the peak over a run with swaps and
    restores must stay within that plus the budget plus a small transient slack."""
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
        from tests.engine_fixtures import make_engine, PROMPTS
        from trtllm_backend.sampling import SamplingParams
        e = make_engine(morph_policy='full', max_tokens_in_paged_kv_cache=1024, force_morph='down:4@2,up:4@30')
        # The KV pool is allocated untouched and becomes resident as blocks are first written (on 2 MiB pages a
        # page at a time): written through first, or the fixed overhead reads low by the untouched part.
        for seg in e.pool.segments:
            seg.kv.zero_()
        fixed = rss() - e.morph.account.used
        for p in PROMPTS:
            e.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True), lambda o: None)
        e.run_until_idle()
        assert e.settle_morph(timeout_s=120)  # the last restores stage in the background: let them land too
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the (big) pytest parent.
        peak = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
        print(json.dumps(dict(fixed=fixed, peak=peak, budget=e.morph.account.budget, swaps=e.counters.swaps_down,
                              restores=e.counters.swaps_up)))
    """)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r)
    # Transients the account does not hold: a step's activations and logits, one INT4 fragment unpacked to
    # int32 while it is packed for the kernel (~14 MB), allocator and thread-pool scratch.
    slack = 64 << 20
    assert r["swaps"] == 4 and r["restores"] == 4
    assert r["peak"] <= r["fixed"] + r["budget"] + slack, f"peak RSS {r['peak']} > {r['fixed']} + {r['budget']} + slack"


def test_a_restore_without_room_drains_another_added_segment(caplog, layer_set):
    # Two swaps, each paying for its own KV segment. Then the budget is cut by the staging reserve (the account
    # still holds): releasing the top layer's segment no longer makes room for its full fragment, so the restore
    # must drain and release the other added segment too, over iterations, logging that once.
    engine = make_engine(morph_policy="full", force_morph="down:2@0,up:1@1", fragment_dir=str(layer_set))
    assert engine.settle_morph(timeout_s=120)
    m = engine.morph
    base, seg_a, seg_b = engine.pool.segments
    assert [s.segment for s in m.swapped] == [seg_a, seg_b]
    m.account.budget -= m.reserve
    assert m.account.used <= m.account.budget
    with caplog.at_level("WARNING", logger="morphserve.morph"):
        outs = collect(engine, PROMPTS[:1], 2)  # one short request moves the engine to iteration 1
        settle(engine)
    assert engine.counters.swaps_up == 1 and engine.num_quantized_layers() == 1
    assert engine.counters.kv_shrinks == 2 and seg_a not in engine.pool.segments and m.swapped[0].segment is None
    assert len([r for r in caplog.records if "draining the KV segment" in r.getMessage()]) == 1
    assert m.account.used <= m.account.budget
    assert outs["p0"][-1].finish_reason == "length"


def test_decode_time_pressure_swaps_only_where_a_swap_was_measured_faster(monkeypatch, layer_set):
    from trtllm_backend.morph import CALIBRATION_BATCHES, MorphManager

    measured = MorphManager.swap_speeds_up

    def run(faster):
        engine = make_engine(
            morph_policy="balanced",
            max_batch_size=1,
            morph_overrides={"down_tpot_s": 1e-6},
            fragment_dir=str(layer_set),
        )
        m = engine.morph
        # the calibration at load: every batch timed, full and INT4 (which is faster depends on the machine)
        assert set(m.speedup) == {"layer"} and set(m.speedup["layer"]) == set(CALIBRATION_BATCHES)
        assert all(0 < r < 100 for r in m.speedup["layer"].values())
        m.speedup["layer"] = {1: 1.2, 4: 0.9, 16: 1.1, 32: 1.0}
        assert [measured(m, b) for b in (1, 2, 4, 5, 16, 20, 64)] == [True, False, False, True, True, False, False]
        monkeypatch.setattr(MorphManager, "swap_speeds_up", lambda self, batch: faster)
        outs = collect(engine, PROMPTS[:3], 6)  # one running, two waiting: TPOT (always above 1 us) is the pressure
        assert all(o[-1].finish_reason == "length" for o in outs.values())
        assert not engine.check_invariants()
        return engine.counters

    assert run(False).swaps_down == 0
    assert run(True).swaps_down >= 1
    # no SLO: nothing measured at load; either default SLO turns its pressure on, so it measures
    assert make_engine(morph_policy="balanced", tpot_slo_s=0, ttft_slo_s=0).morph.speedup == {}
    for policy, slos in (("performance", dict(tpot_slo_s=0)), ("balanced", dict(ttft_slo_s=0)), ("balanced", {})):
        m = make_engine(morph_policy=policy, **slos).morph
        assert m.policy.slowness_counts and m.speedup


def test_queueing_pressure_swaps_while_requests_wait_on_compute(monkeypatch, layer_set):
    from trtllm_backend.morph import MorphManager

    def run(faster):
        # one request runs at a time and the pool is large: the others wait on the step, not on KV blocks
        engine = make_engine(
            morph_policy="balanced",
            max_batch_size=1,
            tpot_slo_s=0,
            morph_overrides={"down_ttft_s": 1e-6},
            fragment_dir=str(layer_set),
        )
        monkeypatch.setattr(MorphManager, "swap_speeds_up", lambda self, batch: faster)
        outs = collect(engine, PROMPTS[:3], 6)
        assert all(o[-1].finish_reason == "length" for o in outs.values())
        assert not engine.check_invariants()
        return engine.counters

    assert run(False).swaps_down == 0
    assert run(True).swaps_down >= 1


def pool_for_base(blocks: int, fragments) -> int:
    """max_tokens_in_paged_kv_cache (block size 8) that leaves a dynamic policy `blocks` base blocks once its
    staging reserve is taken out of the pool."""
    probe = make_engine(
        morph_policy="balanced", block_size=8, max_tokens_in_paged_kv_cache=1024, fragment_dir=str(fragments)
    )
    bpb = probe.pool.bytes_per_block
    return 8 * (blocks + -(-probe.morph.reserve // bpb))


def test_a_restore_draining_under_returning_pressure_is_called_off(layer_set):
    # Two forced swaps add two KV segments; two requests fill the base pool and spill into the first. With nothing
    # waiting the controller restores two units at once (quiet 0 s): the top one's empty segment goes, but the
    # next cannot drain while the requests hold the base pool. A burst then fills the draining segment too (it
    # is the last resort for new blocks) and requests wait for KV: the restore must give way. Before, the
    # manager waited on the drain, which a steady load never lets finish, and so could not swap down either: at
    # pool 256 the pool stayed at 92 blocks through a 100 s burst with 30-57 requests waiting.
    engine = make_engine(
        morph_policy="balanced",
        block_size=8,
        max_tokens_in_paged_kv_cache=pool_for_base(8, layer_set),
        force_morph="down:2@0",
        morph_overrides={"up_quiet_s": 0.0, "down_persist": 1000, "down_queue_wait_s": 0.0, "layers_per_action": 2},
        fragment_dir=str(layer_set),
        enable_prefix_caching=False,  # every request holds blocks of its own: the burst must outgrow the pool
    )
    assert engine.settle_morph(timeout_s=120)
    m = engine.morph
    base, seg_a, seg_b = engine.pool.segments
    words = " ".join(PROMPTS).split()
    prompt = " ".join(
        words[: next(n for n in range(8, len(words)) if len(engine.tokenizer.encode(" ".join(words[:n]))) >= 40)]
    )
    outs = {f"r{i}": [] for i in range(12)}
    for i in range(2):  # 2 x 5 blocks at prefill: the base pool's 8 and 2 of the first segment
        engine.add_request(
            prompt, SamplingParams(max_tokens=16, ignore_eos=True), outs[f"r{i}"].append, request_id=f"r{i}"
        )
    for _ in range(300):
        engine.step()
        if m.draining is seg_a:
            break
    assert m.draining is seg_a and seg_a.draining and len(seg_a.free) < seg_a.num_blocks  # stuck: in use
    assert not any(o and o[-1].finished for o in outs.values())
    assert engine.counters.swaps_up == 1 and seg_b not in engine.pool.segments
    for i in range(2, 12):  # 10 x 5 blocks: more than the 8 + 32 of the pool
        engine.add_request(
            prompt, SamplingParams(max_tokens=8, ignore_eos=True), outs[f"r{i}"].append, request_id=f"r{i}"
        )
    for _ in range(5):
        engine.step()
        if engine.counters.restores_called_off:
            break
    assert engine.counters.restores_called_off == 1 and m.draining is None and not seg_a.draining
    assert engine.num_quantized_layers() == 1 and m.swapped[-1].segment is seg_a and engine.counters.swaps_up == 1
    engine.run_until_idle()
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    assert not engine.check_invariants()


def test_a_multi_unit_restore_gives_way_between_units_when_pressure_returns(monkeypatch, layer_set):
    # A large pool: the restored units' KV segments are empty and drain at once, so the restore never waits on a
    # drain. Before, nothing then stopped it: a 9-unit restore begun in a lull went on unit by unit into the next
    # burst's onset while the queue grew (code trace, pool 2048). Now the returning pressure calls off the units
    # not yet begun; the one being staged still lands.
    import time

    from trtllm_backend.morph import MorphManager

    monkeypatch.setattr(MorphManager, "swap_speeds_up", lambda self, batch: True)
    engine = make_engine(
        morph_policy="balanced",
        max_batch_size=1,
        tpot_slo_s=0,
        force_morph="down:4@0",
        morph_overrides={"up_quiet_s": 0.0, "layers_per_action": 4, "down_ttft_s": 0.3},
        fragment_dir=str(layer_set),
    )
    assert engine.settle_morph(timeout_s=120) and engine.num_quantized_layers() == 4
    m = engine.morph
    outs = {f"r{i}": [] for i in range(4)}
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True), outs["r0"].append, request_id="r0")
    engine.step()  # r0 starts at once: no pressure
    engine.step()  # nothing waiting, quiet 0 s: the controller restores all four units, the first one staging
    assert m.pending_up == 4 and m.job is not None and m.job.kind == "up"
    for i in range(1, 4):  # one row per step: these wait on the step, not on KV blocks (queueing pressure)
        engine.add_request(
            PROMPTS[i], SamplingParams(max_tokens=4, ignore_eos=True), outs[f"r{i}"].append, request_id=f"r{i}"
        )
    time.sleep(0.4)  # the head of the queue waits past down_ttft_s
    engine.step()
    assert engine.counters.restores_called_off == 1
    assert engine.counters.swaps_up + m.pending_up <= 1  # the unit that was staging lands; the other three stay INT4
    assert engine.num_quantized_layers() >= 3
    engine.run_until_idle()
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    assert not engine.check_invariants()
