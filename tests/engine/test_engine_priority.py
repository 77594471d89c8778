"""Request priorities through the engine: the field reaches the scheduler and the outputs, a bad one is refused
with its name, and only the classes within morph_priority_cutoff are load for the morph controller."""

import pytest
from tests.engine_fixtures import PROMPTS, make_engine

from trtllm_backend.errors import InvalidRequest
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.slow


def signals_of(engine) -> list:
    seen = []
    on_iteration = engine.morph.on_iteration
    engine.morph.on_iteration = lambda signals, *a: (seen.append(signals), on_iteration(signals, *a))[1]
    return seen


def burst(engine, priority: int, n: int = 6) -> list:
    outs = []
    for i in range(n):
        engine.add_request(
            f"{i}. " + PROMPTS[5], SamplingParams(max_tokens=24, ignore_eos=True, priority=priority), outs.append
        )
    return outs


@pytest.mark.parametrize("cutoff, counted", [(0, False), (10, True)])
def test_only_the_classes_within_the_cutoff_drive_morphing(cutoff, counted):
    # A pool of 16 blocks: six ~7-block requests queue for KV.
    engine = make_engine(
        morph_policy="balanced", max_tokens_in_paged_kv_cache=400, tpot_slo_s=0.0, morph_priority_cutoff=cutoff
    )
    seen = signals_of(engine)
    outs = burst(engine, priority=5)
    engine.run_until_idle()
    assert any(s.waiting for s in seen) == counted
    if not counted:
        assert engine.counters.swaps_down == 0 and all(s.new_preemptions == 0 for s in seen)
    finals = [o for o in outs if o.finished]
    assert len(finals) == 6 and all(o.priority == 5 for o in finals)


def test_a_bad_priority_is_refused_with_its_name():
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="priority"):
        engine.add_request("hi", _bad_params(), lambda o: None)


def _bad_params() -> SamplingParams:
    params = SamplingParams(max_tokens=2)
    params.priority = 99  # set after construction: the engine checks again at add_request
    return params
