"""MorphManager without a model, one behaviour at a time: staging a swap down, landing it, draining and releasing
its KV segment for a restore, a restore giving way to returning pressure, a staging job that fails, and the memory
budget held throughout. The manager runs on fakes (layer slots and fragments that are byte counts, a manual
executor, a manual clock) and a real KV pool of 256-byte blocks, so each test takes milliseconds; the same paths
on the real model and its INT4 fragments: test_morph.py, test_faults_morph.py, test_head_unit.py."""

import random
from concurrent.futures import Future

import pytest
import torch
from tests.engine.test_kv_cache import TINY

from trtllm_backend.controller import Load, parse_forced, parse_policy
from trtllm_backend.head import HeadSlot
from trtllm_backend.kv_cache import KVPool
from trtllm_backend.manifest import HEAD_UNIT
from trtllm_backend.morph import MorphManager
from trtllm_backend.outputs import EngineStats
from trtllm_backend.precision import HEAD_DYNAMIC, HEAD_FULL, Precision

LAYERS = 4
BLOCK = 256  # bytes of one KV block of TINY at fp32, 4 tokens a block
FULL, INT4 = 16 * BLOCK, 4 * BLOCK  # a swap down frees 12 blocks
HEAD_FULL_BYTES, HEAD_INT8 = 20 * BLOCK, 5 * BLOCK  # the head unit frees 15
SHARED = 3 * BLOCK  # the final norm and the rest that never swaps (the tied table is counted apart)
BASE_BLOCKS = 10


class Weights:
    """A fragment as the manager sees it: its resident bytes."""

    def __init__(self, unit, precision, nbytes):
        self.unit, self.precision, self.nbytes = unit, precision, nbytes


class Slot:
    def __init__(self, index):
        self.index, self.weights, self.precision = index, Weights(index, Precision.FULL, FULL), Precision.FULL

    def bind(self, weights, precision):
        old, self.weights, self.precision = self.weights, weights, precision
        return old


class Manifest:
    dir = "fake-fragments"

    def __init__(self, head=False):
        self.num_layers, self.head = LAYERS, head

    def precisions(self, layer):
        return [Precision.FULL, Precision.INT4]

    def fragment(self, layer, precision):
        return {"bytes": FULL if precision == Precision.FULL else INT4}

    def head_fragment(self, precision):
        return {"bytes": HEAD_INT8 if precision == Precision.INT8 else HEAD_FULL_BYTES}

    def swap_order(self):
        return [2, 0, 3, 1]  # importance order: not the layers' order

    def unit_order(self):
        return [2, HEAD_UNIT, 0, 3, 1] if self.head else self.swap_order()


class Store:
    """Reads a fragment; `broken` units raise as a removed or corrupted file would. `loads` records every read."""

    def __init__(self):
        self.broken: set = set()
        self.loads: list = []

    def load_layer(self, layer, precision):
        return self._load(layer, precision, FULL if precision == Precision.FULL else INT4)

    def load_head(self, precision):
        return self._load(HEAD_UNIT, precision, HEAD_FULL_BYTES if precision == Precision.FULL else HEAD_INT8)

    def _load(self, unit, precision, nbytes):
        self.loads.append((unit, precision))
        if (unit, precision) in self.broken:
            raise OSError(f"fragment of {unit} at {precision} is corrupted")
        return Weights(unit, precision, nbytes)


class ManualExecutor:
    """Runs the submitted staging work only when the test says so (the background thread, made deterministic)."""

    def __init__(self):
        self.queue: list = []

    def submit(self, fn, *args):
        fut = Future()
        self.queue.append((fut, fn, args))
        return fut

    def run(self) -> int:
        done, self.queue = self.queue, []
        for fut, fn, args in done:
            try:
                fut.set_result(fn(*args))
            except Exception as err:  # as a pool thread hands it back
                fut.set_exception(err)
        return len(done)

    def shutdown(self, wait=True, cancel_futures=False):
        self.queue.clear()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Rig:
    """A manager on fakes, and the engine's side of the calls: loads, iterations, running block tables."""

    def __init__(self, policy="balanced", head=False, forced="", budget=None, **overrides):
        self.store, self.executor, self.clock = Store(), ManualExecutor(), Clock()
        self.pool = KVPool(TINY, 4, torch.float32, huge_pages=False)
        assert self.pool.bytes_per_block == BLOCK
        self.slots = [Slot(i) for i in range(LAYERS)]
        head_slot = HeadSlot(Weights(HEAD_UNIT, Precision.FULL, HEAD_FULL_BYTES)) if head else None
        units = LAYERS + head
        self.m = MorphManager(
            parse_policy(policy, units, overrides),
            manifest=Manifest(head),
            store=self.store,
            slots=self.slots,
            pool=self.pool,
            shared_nbytes=SHARED + (HEAD_FULL_BYTES if head else 0),
            counters=EngineStats(),
            head=head_slot,
            head_mode=HEAD_DYNAMIC if head else HEAD_FULL,
            base_kv_blocks=BASE_BLOCKS,
            budget_bytes=budget,
            forced=parse_forced(forced),
            executor=self.executor,
            clock=self.clock,
        )
        self.iteration = 0
        self.tables: list[list[int]] = []  # the running requests' block tables

    def step(self, **load):
        """One engine iteration: a load at the current time (quiet unless told), then the clock moves 50 ms."""
        self.m.on_iteration(Load(now=self.clock.t, **{"waiting": 0, **load}), self.iteration, self.tables)
        self.iteration += 1
        self.clock.t += 0.05
        self.check_account()

    def pressure(self, n=1):
        for _ in range(n):
            self.step(waiting=4, head_wait_s=1.0, kv_usage=0.97, admission_blocked=True, queue_blocks_short=0)

    def quiet(self, seconds):
        for _ in range(round(seconds / 0.05)):
            self.step(waiting=0)

    def check_account(self):
        """The account is what is resident, and within the budget."""
        a, m = self.m.account, self.m
        head = m.head.table.nbytes if m.head is not None else 0
        assert a.layers == sum(s.weights.nbytes for s in self.slots)
        assert a.shared == SHARED + head and a.kv == self.pool.nbytes
        assert a.staged == (m.job.staged_bytes if m.job else 0)
        assert a.used <= a.budget

    def precisions(self):
        return [s.precision for s in self.slots]


def test_the_budget_is_the_full_model_plus_the_base_pool_less_the_staging_reserve():
    r = Rig()
    a = r.m.account
    assert a.budget == SHARED + LAYERS * FULL + BASE_BLOCKS * BLOCK
    assert r.m.reserve == INT4 and r.pool.num_blocks == BASE_BLOCKS - INT4 // BLOCK
    assert r.m.blocks_per_layer == (FULL - INT4) // BLOCK
    static = Rig("full")
    assert static.m.reserve == 0 and static.pool.num_blocks == BASE_BLOCKS  # a static policy stages nothing


def test_a_static_policy_binds_its_int4_layers_at_load_and_turns_the_bytes_into_kv():
    r = Rig("int4:2")
    assert r.precisions() == [Precision.INT4, Precision.FULL, Precision.INT4, Precision.FULL]  # order 2, 0
    assert r.pool.num_blocks == BASE_BLOCKS + 2 * (FULL - INT4) // BLOCK and len(r.pool.segments) == 1
    assert r.m.swapped_layers == [2, 0] and r.m.counters.swaps_down == 2 and not r.executor.queue


def test_a_swap_down_is_staged_in_the_background_then_lands_and_buys_kv():
    r = Rig()
    r.pressure()  # one pressured iteration: balanced waits for two
    assert not r.m.busy(r.iteration) and not r.executor.queue
    r.pressure()
    assert r.m.pending_down == 2 and r.m.job.kind == "down" and r.m.job.unit == 2  # the first of the swap order
    assert r.m.account.staged == INT4 and r.store.loads == []  # submitted, not yet run
    blocks = r.pool.num_blocks
    r.pressure(3)  # the job is not done: the engine keeps stepping, nothing changes
    assert r.m.job.unit == 2 and r.pool.num_blocks == blocks and r.slots[2].precision == Precision.FULL
    r.clock.t += 0.25
    assert r.executor.run() == 1
    r.step()
    assert r.slots[2].precision == Precision.INT4 and r.m.swapped_layers == [2]
    assert r.pool.num_blocks == blocks + (FULL - INT4) // BLOCK and len(r.pool.segments) == 2
    assert r.m.counters.swaps_down == 1 and r.m.counters.kv_grows == 1
    assert r.m.job.unit == 0 and r.m.pending_down == 1  # the second unit of the action is staged at once
    total, timings = r.m.swap_log.snapshot()
    assert total == 1 and timings[0][0] == pytest.approx(0.45)  # prepare: submitted at 100.05, landed at 100.5
    r.executor.run()
    r.step()
    assert r.m.swapped_layers == [2, 0] and not r.m.busy(r.iteration)
    assert r.m.account.available < BLOCK  # every freed byte became KV, less a block's remainder


def down(r, n_actions=1):
    """Swap down the policy's step (`n_actions` times), landing every staged fragment."""
    for _ in range(n_actions):
        r.pressure(2)
        while r.m.busy(r.iteration):
            r.executor.run()
            r.step()


def test_a_quiet_spell_drains_releases_and_restores_last_swapped_first():
    r = Rig()
    down(r)
    blocks_at_load = BASE_BLOCKS - INT4 // BLOCK
    assert len(r.pool.segments) == 3
    r.quiet(r.m.policy.up_quiet_s - 0.1)
    assert r.m.pending_up == 0  # not quiet long enough yet
    r.quiet(0.15)
    # The newest segment (layer 0's) is empty: released at once, then the full fragment is staged in its bytes.
    assert r.m.pending_up == 2 and r.m.job.kind == "up" and r.m.job.unit == 0
    assert len(r.pool.segments) == 2 and r.m.counters.kv_shrinks == 1 and r.m.account.staged == FULL
    r.executor.run()
    r.step()
    assert r.slots[0].precision == Precision.FULL and r.m.swapped_layers == [2] and r.m.job.unit == 2
    r.executor.run()
    r.step()
    assert r.precisions() == [Precision.FULL] * LAYERS and r.m.morphed_units == 0 and not r.m.busy(r.iteration)
    assert r.m.counters.swaps_up == 2 and r.m.counters.kv_shrinks == 2
    assert r.pool.num_blocks == blocks_at_load and len(r.pool.segments) == 1  # back where it started
    assert [u for u, p in r.store.loads] == [2, 0, 0, 2]


def test_a_drain_moves_live_blocks_out_when_room_comes_and_rewrites_their_tables():
    r = Rig()
    down(r)
    top = r.m.swapped[-1].segment
    live = r.pool.allocate(3)  # earliest segments first: outside the top one
    rest = r.pool.allocate(r.pool.num_free - len(top.free))  # everything else outside it: nowhere to move yet
    in_top = r.pool.allocate(2)
    assert not any(top.owns(b) for b in live + rest) and all(top.owns(b) for b in in_top)
    r.tables = [live, rest, in_top]
    r.m.controller.forced = parse_forced(f"up:1@{r.iteration}")  # the load stays high: a forced restore drains
    r.step(waiting=0, kv_usage=0.99)
    assert r.m.draining is top and top.draining and r.m.busy(r.iteration)
    r.quiet(0.5)
    assert (
        r.m.draining is top and r.m.job is None
    )  # no free block outside it: the drain waits, iteration after iteration
    r.pool.free(live)  # a request finishes: room for the two live blocks
    r.tables.remove(live)
    before = list(in_top)
    r.step()
    assert r.m.draining is None and top not in r.pool.segments and r.m.counters.kv_shrinks == 1
    assert r.tables[-1] is in_top and not any(top.owns(b) for b in in_top) and in_top != before  # moved in place
    assert r.m.job.kind == "up" and r.m.job.unit == 0
    r.executor.run()
    r.step()
    assert r.m.swapped_layers == [2] and not r.m.busy(r.iteration)


def test_a_drain_gives_way_to_returning_pressure_and_the_next_restore_waits_for_a_new_quiet_spell():
    r = Rig()
    down(r)
    r.quiet(r.m.policy.up_quiet_s + 0.05)
    assert r.m.job.unit == 0 and r.m.pending_up == 2  # the top segment was empty: released, layer 0 staging
    base, seg = r.pool.segments  # layer 2's segment is next to drain
    # Load arrives meanwhile (no pressure yet): the base pool full, two blocks in layer 2's segment.
    r.tables = [r.pool.allocate(len(base.free)), r.pool.allocate(2)]
    assert all(seg.owns(b) for b in r.tables[1])
    r.executor.run()
    r.step()
    assert r.m.swapped_layers == [2] and r.m.draining is seg and r.m.pending_up == 1  # no room to move its blocks
    r.step()
    assert r.m.draining is seg and seg.draining  # waits, iteration after iteration
    r.pressure()  # pressure returns mid-drain
    assert r.m.draining is None and not seg.draining and r.m.pending_up == 0 and not r.m.busy(r.iteration)
    assert r.m.counters.restores_called_off == 1 and r.m.controller.last_pressure == pytest.approx(r.clock.t - 0.05)
    assert r.m.swapped_layers == [2] and seg in r.pool.segments
    for table in r.tables:  # the load goes; the next restore waits a whole quiet spell from the pressure
        r.pool.free(table)
    r.tables = []
    r.quiet(r.m.policy.up_quiet_s - 0.1)
    assert r.m.pending_up == 0 and r.m.draining is None
    r.quiet(0.15)
    assert r.m.pending_up == 1 and r.m.job.unit == 2 and seg not in r.pool.segments


def test_a_unit_already_staging_still_lands_when_the_rest_of_the_restore_gives_way():
    r = Rig()
    down(r)
    r.quiet(r.m.policy.up_quiet_s + 0.05)
    assert r.m.job.kind == "up" and r.m.job.unit == 0 and r.m.pending_up == 2
    r.pressure()
    assert r.m.pending_up == 1 and r.m.counters.restores_called_off == 1  # only the one staging is left
    r.executor.run()
    r.step()
    assert r.m.swapped_layers == [2] and r.slots[0].precision == Precision.FULL and not r.m.busy(r.iteration)


def test_a_forced_restore_does_not_give_way():
    r = Rig()
    down(r)
    top = r.m.swapped[-1].segment
    r.tables = [r.pool.allocate(r.pool.num_free - len(top.free)), r.pool.allocate(1)]
    r.m.controller.forced = parse_forced(f"up:2@{r.iteration}")
    r.step()
    assert r.m.draining is top and r.m.restore_forced
    r.pressure(3)
    assert r.m.draining is top and r.m.counters.restores_called_off == 0


def test_a_fragment_that_fails_to_stage_down_is_skipped_for_the_next_unit():
    r = Rig()
    r.store.broken.add((2, Precision.INT4))
    r.pressure(2)
    r.executor.run()
    r.step()
    assert r.m.counters.swap_failures == 1 and r.m.failed == {2} and r.slots[2].precision == Precision.FULL
    assert r.m.job.unit == 0 and r.m.pending_down == 1  # the rest of the action goes on with the next unit
    r.executor.run()
    r.step()
    assert r.m.swapped_layers == [0] and not r.m.busy(r.iteration)
    down(r)
    assert r.m.swapped_layers == [0, 3]  # the failed unit is never tried again (balanced stops at 2 of 4)


def test_a_full_fragment_that_fails_at_restore_leaves_the_unit_swapped_down_and_its_kv_grown_back():
    r = Rig()
    down(r)
    r.store.broken.add((0, Precision.FULL))
    blocks = r.pool.num_blocks
    r.quiet(r.m.policy.up_quiet_s + 0.05)
    assert r.m.job.unit == 0 and r.pool.num_blocks < blocks  # its segment released for the staging
    r.executor.run()
    r.step()
    assert r.m.counters.swap_failures == 1 and r.m.pending_up == 0
    assert [s.unit for s in r.m.stuck] == [0] and r.m.stuck[0].segment is not None
    assert r.m.swapped_layers == [2, 0] and r.m.morphed_units == 1 and r.pool.num_blocks == blocks
    r.quiet(r.m.policy.up_quiet_s + 0.05)  # the rest of the stack can still be restored
    while r.m.busy(r.iteration):
        r.executor.run()
        r.step()
    assert r.m.swapped_layers == [0] and r.m.morphed_units == 0 and r.slots[2].precision == Precision.FULL


def test_the_head_is_a_unit_at_its_place_in_the_swap_order():
    r = Rig(head=True)
    assert r.m.order == [2, HEAD_UNIT, 0, 3, 1] and r.m.reserve == HEAD_INT8  # the largest staging
    down(r)
    assert r.m.head.precision == Precision.INT8 and r.m.head_int8 and r.m.int4_layers == 1 and r.m.morphed_units == 2
    assert len(r.pool.segments) == 3 and r.pool.segments[-1].num_blocks >= (HEAD_FULL_BYTES - HEAD_INT8) // BLOCK
    r.quiet(r.m.policy.up_quiet_s + 0.05)
    while r.m.busy(r.iteration):
        r.executor.run()
        r.step()
    assert r.m.head.precision == Precision.FULL and not r.m.head_int8 and r.m.morphed_units == 0


@pytest.mark.parametrize("seed", range(5))
def test_the_budget_holds_through_random_load_and_staging(seed):
    """Random load, random staging delays and random block use: the account always matches what is resident and
    stays within the budget (Rig.step checks it each iteration), and every block table stays valid."""
    rng = random.Random(seed)
    r = Rig(head=bool(seed % 2), down_persist=1, up_quiet_s=0.2)
    for i in range(600):
        burst = i % 150 < 50  # a burst, then a lull
        if rng.random() < 0.3:
            r.executor.run()
        if r.tables and rng.random() < (0.2 if burst else 0.5):
            r.pool.free(r.tables.pop(rng.randrange(len(r.tables))))
        if rng.random() < (0.5 if burst else 0.1) and (blocks := r.pool.allocate(rng.randint(1, 4))) is not None:
            r.tables.append(blocks)
        if rng.random() < (0.5 if burst else 0.02):
            r.pressure()
        else:
            r.step(waiting=0, kv_usage=r.pool.num_used / r.pool.num_blocks)
        live = [b for t in r.tables for b in t]
        assert len(live) == len(set(live)) and all(not r.pool.segment_of(b).draining or r.m.draining for b in live)
    assert r.m.counters.swaps_down >= 2 and r.m.counters.swaps_up >= 2


def test_whether_a_swap_is_faster_is_asked_of_the_next_units_kind():
    r = Rig(head=True)
    assert not r.m.swap_speeds_up(1)  # nothing measured (no slowness pressure configured)
    r.m.speedup = {"layer": {1: 1.3, 16: 1.0}, "lm_head": {1: 0.9, 16: 1.6}}  # as _calibrate leaves it
    assert r.m.swap_speeds_up(1) and not r.m.swap_speeds_up(8)  # layer 2 next; batch 8 is judged at 16
    down(r)  # layer 2 and the head swapped: layer 0 next
    assert r.m.order[:2] == [2, HEAD_UNIT] and r.m.swap_speeds_up(1)
    r.m.speedup["layer"] = {1: 1.0}
    assert not r.m.swap_speeds_up(1)
    r2 = Rig(head=True)
    r2.m.failed.add(2)  # the head is next
    r2.m.speedup = {"layer": {1: 1.3}, "lm_head": {1: 0.9, 16: 1.6}}
    assert not r2.m.swap_speeds_up(1) and r2.m.swap_speeds_up(16)
