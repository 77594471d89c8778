"""Runtime morphing: quantized layer swapping plus pressure-aware KV cache resizing.

The morph manager is built from what it acts on (the layer slots, the KV pool, the fragment store and
manifest, the engine's counters) and owns its memory account. The engine calls `on_iteration` once per
iteration, between two iterations on the engine thread, with that iteration's `Load` and the block tables
of the running requests; the manager adds its own state to make the controller's `Signals`, and every state
change happens inside that call. Reading and preparing a fragment
happens on a background thread while the engine keeps stepping; only the rebinding (and the KV segment
change it pays for) happens on the engine thread.

The units swapped are the decoder layers (to INT4) and, with lm_head_precision=dynamic, the tied embedding / LM
head table (to INT8), in one order (Manifest.unit_order) and behind one protocol (units.SwapUnit): the controller's
counts are units. Otherwise the head is bound at load to the precision it is configured with, like a static
policy's INT4 layers.

Memory: one budget bounds everything resident, whichever policy runs. The manager binds the policy's weights at
load, then allocates the KV pool from what the budget leaves: all of it for a static policy, all but a staging
reserve (room to stage the largest unit's quantized fragment) for a dynamic one. The budget defaults to the
full-precision model plus the configured KV pool, so every policy given one configuration holds the same memory.

Swap down, one unit at a time: stage the quantized fragment (in the reserve) -> rebind the slot -> drop the
full fragment -> the freed bytes become a new KV segment of whole blocks.
Restore, most recent swap first: stop allocating from that layer's segment, move its live blocks into free
blocks elsewhere (over as many iterations as it takes), release it -> stage the full fragment in the released
bytes -> rebind. If the full fragment still does not fit, the newest other added segment is drained and
released the same way, one at a time; with none left the restore is given up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Callable

from .controller import Action, Controller, Load, MorphPolicy, Signals
from .errors import FragmentError
from .fragments import FragmentStore
from .head import HeadSlot
from .kv_cache import KVPool, KVSegment
from .layers import LayerSlot
from .manifest import HEAD_UNIT, Manifest
from .memory import MemoryAccount, blocks_freed, resolve_budget
from .outputs import EngineStats
from .precision import HEAD_DYNAMIC, HEAD_FULL, HEAD_INT8, Precision
from .units import HeadUnit, LayerUnit, SwapUnit

log = logging.getLogger("morphserve.morph")

# The decode-speed calibration (TPOT and queueing pressure): batches timed, runs per form (the fastest counts),
# the buffer streamed before each run to evict the weights (larger than this CPU's L3), and the speed-up that counts.
CALIBRATION_BATCHES = (1, 4, 16, 32)
CALIBRATION_REPS = 5
CALIBRATION_FLUSH_BYTES = 64 << 20
SPEEDUP_MARGIN = 1.05  # below it the difference is within run-to-run noise here


Unit = int | str  # a unit's key: a layer index, or HEAD_UNIT (units.SwapUnit)


@dataclass(slots=True)
class _Job:
    kind: str  # "down" or "up"
    unit: Unit
    future: Future
    staged_bytes: int
    started: float


@dataclass(slots=True)
class _Swapped:
    unit: Unit
    segment: KVSegment | None  # the KV blocks this swap paid for (None once released)


class SwapLog:
    """(prepare_s, apply_s) of every finished swap. Appended on the engine thread; read from any thread with
    no side effect: `total` counts every swap ever timed, the snapshot holds the most recent `keep`."""

    def __init__(self, keep: int = 256):
        self._recent: deque[tuple[float, float]] = deque(maxlen=keep)
        self.total = 0
        self._lock = threading.Lock()

    def record(self, prepare_s: float, apply_s: float) -> None:
        with self._lock:
            self._recent.append((prepare_s, apply_s))
            self.total += 1

    def snapshot(self) -> tuple[int, tuple[tuple[float, float], ...]]:
        """(total, the most recent timings oldest first); the last entry is swap number `total`."""
        with self._lock:
            return self.total, tuple(self._recent)


@dataclass
class MorphManager:
    policy: MorphPolicy
    manifest: Manifest
    store: FragmentStore
    slots: list[LayerSlot]
    pool: KVPool
    shared_nbytes: int  # embedding, final norm, LM head as loaded (the head's part follows `head` when it swaps)
    counters: EngineStats  # the engine's live counters: swaps, KV grows and shrinks, failures
    head: HeadSlot | None = None  # the tied embedding / LM head
    head_mode: str = HEAD_FULL  # lm_head_precision resolved (head.head_mode): int8 and dynamic need the INT8 table
    base_kv_blocks: int = 0  # the KV pool the default budget holds beside the full-precision model
    budget_bytes: int | None = None  # default: the full-precision model + base_kv_blocks
    forced: dict[int, Action] = field(default_factory=dict)  # engine iteration -> action (controller.parse_forced)
    # Where fragments are read and prepared (default: one background thread of its own), and the clock that times
    # each swap: both given in by tests that run the manager without a model (tests/engine/test_morph_manager_fakes.py).
    executor: Executor | None = None
    clock: Callable[[], float] = time.monotonic
    swapped: list[_Swapped] = field(default_factory=list)  # a stack: restores pop from the end
    failed: set[Unit] = field(default_factory=set)
    # Swapped down, and their full fragment failed to load at restore: they stay so until a restart (outside
    # the controller's count, so it does not retry them every quiet spell).
    stuck: list[_Swapped] = field(default_factory=list)
    pending_down: int = 0
    pending_up: int = 0
    job: _Job | None = None
    draining: KVSegment | None = None  # being emptied for a restore
    restore_forced: bool = False  # the restore under way was forced (parse_forced): it does not give way

    def __post_init__(self):
        m = self.manifest
        self.controller = Controller(self.policy, forced=dict(self.forced))
        self.swap_log = SwapLog()
        self.quantizable = all(Precision.INT4 in m.precisions(i) for i in range(m.num_layers))
        rebindable_head = self.head is not None and self.head.swappable  # tied (head.head_mode checked the set)
        self.head_unit = self.quantizable and self.head_mode == HEAD_DYNAMIC
        self.order: list[Unit] = m.unit_order() if self.head_unit else m.swap_order()
        # The layers' unswapped form: full, or every layer's Q4_1 fragment (policy q4_1).
        self.base = Precision(self.policy.base_precision)
        if self.base != Precision.FULL and not all(self.base in m.precisions(i) for i in range(m.num_layers)):
            raise FragmentError(
                f"morph_policy {self.policy.name}: the fragment set has no {self.base} fragment for every "
                f"layer (build them with python -m engines.build_fragments --q4-1)"
            )
        self.units: dict[Unit, SwapUnit] = {
            slot.index: LayerUnit(slot, self.store, m, up=self.base) for slot in self.slots
        }
        if self.head_unit:
            self.units[HEAD_UNIT] = HeadUnit(self.head, self.store, m)
        # Bytes staged for each unit's swap down (manifest upper bounds); the reserve holds the largest.
        self.down_bytes: dict[Unit, int] = (
            {k: u.down_bytes() for k, u in self.units.items()} if self.quantizable else {}
        )
        # NOTE: only a policy that swaps while serving (or forced actions: benchmarks, tests) stages anything; a
        # static one spends the reserve on KV.
        swaps_live = (self.policy.dynamic or bool(self.forced)) and self.quantizable
        self.reserve = max(self.down_bytes.values(), default=0) if swaps_live else 0
        # Resident bytes of each full-precision unit, known exactly before anything is swapped.
        self.full_bytes: dict[Unit, int] = {k: u.bound.nbytes for k, u in self.units.items()}
        # the shared bytes that never swap (the norm, an untied head); a tied table's bytes follow its binding
        self._fixed_shared = self.shared_nbytes - (self.head.table.nbytes if rebindable_head else 0)
        # KV blocks one swapped layer buys (what the controller sizes a swap with; the head buys more).
        self.blocks_per_layer = blocks_freed(self.full_bytes[0], self.down_bytes.get(0, 0), self.pool.bytes_per_block)
        self.account = MemoryAccount(budget=0, reserve=self.reserve, shared=self.shared_nbytes)
        self._refresh()
        self.account.budget = resolve_budget(
            self.account.used,
            reserve=self.reserve,
            bytes_per_block=self.pool.bytes_per_block,
            base_kv_blocks=self.base_kv_blocks,
            given=self.budget_bytes,
            policy_name=self.policy.name,
        )
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="morphserve-fragments")
        self._unseen_preemptions = 0
        self._unseen_evicted_miss_s = 0.0
        # full / quantized decode time of each kind of unit by batch (the slowness pressures' evidence), measured here
        self.speedup: dict[str, dict[int, float]] = {}
        if self.policy.dynamic and self.policy.slowness_counts and self.quantizable:
            self._calibrate()
        if (self.policy.dynamic or self.policy.static_int4_layers) and not self.quantizable:
            if self.policy.static_int4_layers:
                raise FragmentError(
                    f"morph_policy {self.policy.name}: the fragment set has no INT4 fragments (build them with engines.quantize_awq)"
                )
            log.warning("no INT4 fragments in %s: morphing is off, serving at full precision", m.dir)
        self._bind_at_load()
        if self._grow_kv(resize=False) is None:  # never expected: resolve_budget checked the room for a block
            raise AssertionError(f"no KV block fits the budget ({self.account})")

    # ---- state the engine reads (engine thread) --------------------------------------------------------
    @property
    def int4_layers(self) -> int:
        """Decoder layers bound to INT4."""
        return len(self.swapped_layers)

    @property
    def morphed_units(self) -> int:
        """Units swapped down that can be restored (INT4 layers and the INT8 head): what the controller counts."""
        return len(self.swapped)

    @property
    def head_int8(self) -> bool:
        """The head should be bound to its INT8 table: configured so, or swapped down as a unit."""
        return self.head_mode == HEAD_INT8 or any(
            self.units[s.unit].kind == HeadUnit.kind for s in self.swapped + self.stuck
        )

    @property
    def swapped_layers(self) -> list[int]:
        return [s.unit for s in self.swapped + self.stuck if self.units[s.unit].kind == LayerUnit.kind]

    def usage_after_shrink(self, reserved_blocks: int = 0) -> float:
        """KV usage if the most recent swap's blocks were gone (1.0 when nothing can shrink); cached blocks nobody
        holds count as free (a shrink drops the coldest of them: KVPool.evacuate), blocks promised to running
        requests (`reserved_blocks`, guaranteed_no_evict) as used."""
        p = self.pool
        top = self.swapped[-1].segment if self.swapped else None
        remaining = p.num_blocks - (top.num_blocks if top else 0)
        return (p.num_used + reserved_blocks) / remaining if self.swapped and remaining > 0 else 1.0

    def busy(self, iteration: int) -> bool:
        """An action is in flight, queued, or forced at or before `iteration`."""
        return bool(
            self.job
            or self.draining
            or self.pending_down
            or self.pending_up
            or (self.quantizable and self.controller.forced_due(iteration))
        )

    def wait(self, timeout_s: float) -> None:
        """Block until the fragment being prepared in the background (if any) is ready, or the timeout."""
        if self.job is not None:
            wait_futures([self.job.future], timeout=timeout_s)

    def swap_speeds_up(self, batch: int) -> bool:
        """Whether the next swap down was measured to make a decode step of `batch` rows faster (TPOT and queueing
        pressure)."""
        candidates = self._candidates() if self.speedup else []
        if not candidates:
            return False
        ratios = self.speedup[self.units[candidates[0]].kind]
        at = min((b for b in ratios if b >= batch), default=max(ratios))  # the nearest measured batch at or above
        return ratios[at] >= SPEEDUP_MARGIN

    # ---- decode speed ---------------------------------------------------------------------------
    def _calibrate(self) -> None:
        """Time the first layer and (when a unit) the head of the swap order, full vs quantized, at decode batch
        sizes. Cold: a buffer larger than the caches is streamed before each run, since in decode every weight
        comes from memory. Runs at load, only with the TPOT or queueing pressure on (0.9 s here with the head, one busy core)."""
        import torch

        t0 = time.monotonic()
        firsts: dict[str, SwapUnit] = {}  # the first unit of each kind in the swap order
        for key in self.order:
            firsts.setdefault(self.units[key].kind, self.units[key])
        forms = {
            kind: (unit, unit.bound, unit.load(down=True))
            for kind, unit in sorted(firsts.items(), key=lambda ku: ku[0] != "layer")
        }  # the layer first
        flush = torch.empty(CALIBRATION_FLUSH_BYTES // 4)
        c = self.manifest.config

        with torch.inference_mode():
            for kind, (unit, full, quant) in forms.items():
                self.speedup[kind] = {}
                for batch in CALIBRATION_BATCHES:
                    x, xi = torch.randn(batch, c.hidden_size), torch.randn(batch, c.intermediate_size)
                    best = {}
                    for name, weights in (("full", full), ("quant", quant)):
                        times = []
                        for _ in range(CALIBRATION_REPS):
                            flush.fill_(1.0)
                            t = time.perf_counter()
                            unit.decode(weights, x, xi)
                            times.append(time.perf_counter() - t)
                        best[name] = min(times)
                    self.speedup[kind][batch] = best["full"] / best["quant"]
        del forms, flush
        log.info(
            "morph: decode speed full/quantized by batch, measured at load in %.0f ms: %s",
            (time.monotonic() - t0) * 1e3,
            {k: {b: round(r, 2) for b, r in v.items()} for k, v in self.speedup.items()},
        )

    # ---- accounting -----------------------------------------------------------------------------
    def _bind_at_load(self) -> None:
        """Bind the configured INT8 head, the policy's base form of every layer where it is not full (q4_1) and a
        static policy's INT4 layers before any KV exists. NOTE: each
        quantized form is read while its full form is still bound: the load peaks one fragment above the budget,
        which bounds what is resident from then on (and checks every allocation against it)."""
        if self.head_mode == HEAD_INT8:
            self.head.bind(self.store.load_head(Precision.INT8), Precision.INT8)
        if self.base != Precision.FULL:  # not swaps: the form each layer is served in (and restored to)
            for slot in self.slots:
                layer = self.units[slot.index]
                layer.bind(layer.load(down=False), down=False)
        for unit in self._candidates()[: self.policy.static_int4_layers]:
            self.units[unit].bind(self.units[unit].load(down=True), down=True)
            self.swapped.append(_Swapped(unit, None))
            self.counters.swaps_down += 1
        self._refresh()

    def _refresh(self) -> None:
        """Count what is resident now into the account (memory.MemoryAccount.update checks it against the budget)."""
        head = self.head.table.nbytes if self.head is not None and self.head.swappable else 0
        self.account.update(
            shared=self._fixed_shared + head,
            layers=sum(s.weights.nbytes for s in self.slots),
            kv=self.pool.nbytes,
            staged=self.job.staged_bytes if self.job else 0,
        )

    def _grow_kv(self, resize: bool = True) -> KVSegment | None:
        """What the budget leaves, as a new KV segment; counted as a resize unless it is the pool made at load."""
        n = self.pool.blocks_for_bytes(self.account.available)
        if n <= 0:
            return None
        seg = self.pool.add_segment(n)
        self.counters.kv_grows += resize
        self._refresh()
        return seg

    # ---- the per-iteration call (engine thread) -------------------------------------------------
    def signals(self, load: Load) -> Signals:
        """The controller's signals: the engine's `load` and this manager's state now (units swapped, the blocks a
        swap buys, KV usage after a shrink, whether the next swap is faster at the load's batch)."""
        return Signals.of(
            load,
            blocks_per_layer=self.blocks_per_layer,
            int4_layers=self.morphed_units,
            usage_after_shrink=self.usage_after_shrink(load.kv_reserved_blocks),
            swap_speeds_up=self.swap_speeds_up(load.batch) if self.policy.slowness_counts else False,
        )

    def on_iteration(self, load: Load, iteration: int, block_tables: list[list[int]]) -> None:
        """Advance morphing by one iteration. `load` was taken before this call and `block_tables` are the
        running requests' tables (rewritten in place when their blocks move out of a draining segment)."""
        signals = self.signals(load)  # before anything below changes the state they describe
        self._unseen_preemptions += signals.new_preemptions  # kept for the next decision if none is made now
        self._unseen_evicted_miss_s += signals.evicted_miss_s
        changed = False
        if self.job and self.job.future.done():
            self._finish_job()
            changed = True
        if self._restore_under_way():
            changed |= self._restore_gives_way(signals) or (
                self.draining is not None and self._continue_drain(block_tables)
            )
        # NOTE: the signals describe the state before this call; after a swap or a release in this call the
        # decision waits for the next iteration's signals.
        idle = self.job is None and self.draining is None and not (self.pending_down or self.pending_up)
        if idle and not changed and self.quantizable:
            signals.new_preemptions, self._unseen_preemptions = self._unseen_preemptions, 0
            signals.evicted_miss_s, self._unseen_evicted_miss_s = self._unseen_evicted_miss_s, 0.0
            action = self.controller.decide(signals, iteration)
            if action:
                self._accept(action)
        elif self.quantizable:
            self.controller.hold(signals)
        acted = changed or self.draining is not None
        if self.job is None and self.draining is None:
            if self.pending_down:
                self._start_down()
                acted = True
            elif self.pending_up:
                self._start_up(block_tables)
                acted = True
        # NOTE: each change of the bound weights, the KV segments or the staged bytes refreshes the account
        # where it happens; this one is a net for those paths. An iteration that did none of them leaves the
        # account as it was (and the memory invariant then compares it with the tensors, not with itself).
        if acted:
            self._refresh()

    def _accept(self, action: Action) -> None:
        if action.kind == "down":
            k = min(action.layers, len(self._candidates()))
            if k:
                self.pending_down = k
                log.info("morph: swap %d unit(s) down (%d now) - %s", k, self.morphed_units, action.reason)
        else:
            k = min(action.layers, self.morphed_units)
            if k:
                self.pending_up = k
                self.restore_forced = action.forced
                log.info(
                    "morph: restore %d unit(s) to full precision (%d swapped now) - %s",
                    k,
                    self.morphed_units,
                    action.reason,
                )

    def _candidates(self) -> list[Unit]:
        done = {s.unit for s in self.swapped}
        return [i for i in self.order if i not in done and i not in self.failed]

    # ---- swap down ------------------------------------------------------------------------------------
    def _start_down(self) -> None:
        candidates = self._candidates()
        if not candidates:
            self.pending_down = 0
            return
        unit = candidates[0]
        staged = self.down_bytes[unit]
        if not self.account.fits(staged):
            # NOTE: nothing frees budget on its own (KV grows only into what is left): waiting would retry every
            # iteration and keep the manager busy forever
            log.warning(
                "morph: no room to stage %s (%d bytes, %d of %d budget bytes used); the swap is given up",
                self.units[unit].name,
                staged,
                self.account.used,
                self.account.budget,
            )
            self.pending_down = 0
            return
        self._submit("down", unit, staged)

    def _submit(self, kind: str, unit: Unit, staged: int) -> None:
        fut = self.executor.submit(self.units[unit].load, kind == "down")
        self.job = _Job(kind, unit, fut, staged, self.clock())
        self._refresh()

    def _finish_job(self) -> None:
        job, self.job = self.job, None
        prepare = self.clock() - job.started
        try:
            weights = job.future.result()
        except Exception as err:  # anything the staging thread raised (a bad file, a failed allocation, a bug)
            self.counters.swap_failures += 1
            if job.kind == "down":
                log.error("morph: cannot load %s for down: %s; it stays where it is", self.units[job.unit].name, err)
                self.failed.add(job.unit)
                self.pending_down = max(0, self.pending_down - 1)
                self._refresh()
            else:
                self._restore_failed(err)
            return
        t0 = self.clock()
        if job.kind == "down":
            precision = self.units[job.unit].bind(weights, down=True)
            del weights  # the full fragment's memory goes back now (the slot held the only other reference)
            self._refresh()
            seg = self._grow_kv()
            self.swapped.append(_Swapped(job.unit, seg))
            self.counters.swaps_down += 1
            self.pending_down -= 1
        else:
            precision = self.units[job.unit].bind(weights, down=False)
            del weights
            self.swapped.pop()
            self.counters.swaps_up += 1
            self.pending_up = max(0, self.pending_up - 1)  # 0 already where the rest of the restore gave way
            self._refresh()
            self._grow_kv()  # the INT4 fragment's bytes are free again: keep the reserve, use the rest
        apply = self.clock() - t0
        self.swap_log.record(prepare, apply)
        log.info(
            "morph: %s -> %s (prepare %.1f ms, apply %.2f ms, KV %d blocks, %d INT4 layers, lm_head %s)",
            self.units[job.unit].name,
            precision,
            prepare * 1e3,
            apply * 1e3,
            self.pool.num_blocks,
            self.int4_layers,
            Precision.INT8 if self.head_int8 else Precision.FULL,
        )

    # ---- restore -----------------------------------------------------------------------------------
    def _restore_failed(self, err: Exception) -> None:
        """The top unit's full fragment did not load (removed or corrupted since the swap down): it stays swapped
        down until a restart, its KV segment (already drained) is grown back, and the rest of the stack can still
        be restored. Logged once per unit, as it is never tried again."""
        top = self.swapped.pop()
        self.failed.add(top.unit)
        self.pending_up = 0
        self._refresh()
        top.segment = self._grow_kv()
        self.stuck.append(top)
        log.error(
            "morph: cannot restore %s to full precision: %s; it stays swapped down until the fragment is "
            "repaired and the server restarted",
            self.units[top.unit].name,
            err,
        )

    def _start_up(self, block_tables: list[list[int]]) -> None:
        if not self.swapped:
            self.pending_up = 0
            return
        top = self.swapped[-1]
        if top.segment is not None:
            self.draining = top.segment
            self._continue_drain(block_tables)
        else:
            self._stage_full(block_tables)

    def _staging_up(self) -> int:
        """1 while a full fragment is being staged for a restore (that unit lands whatever follows), else 0."""
        return int(self.job is not None and self.job.kind == "up")

    def _restore_under_way(self) -> bool:
        """A restore has work not yet begun: a KV segment draining, or units after the one being staged."""
        return self.draining is not None or self.pending_up > self._staging_up()

    def _restore_gives_way(self, signals: Signals) -> bool:
        """A restore is called off when pressure returns, between any two of its steps; True if it was. A unit
        whose full fragment is already being staged still lands; the units after it stay swapped down.
        Why, while a KV segment drains: the draining segment takes no new blocks, so under load its blocks are not
        freed, and the wait shrinks the pool just when it is needed and keeps the manager busy, so it cannot swap
        down either. Why between units: a long restore begun in a lull runs into the next burst's onset and
        delays the swaps down it needs (both seen in capacity runs: docs/architecture.md, "Why the thresholds")."""
        if self.restore_forced or not self.controller.policy.dynamic:
            return False
        why = self.controller.pressure(signals)
        if not why:
            return False
        staging_up = self._staging_up()
        left = self.pending_up - staging_up
        if self.draining is not None:
            seg, self.draining = self.draining, None
            seg.draining = False  # it takes new blocks again; what already moved out stays where it went
        self.pending_up = staging_up
        self.controller.restore_called_off(signals.now)
        self.counters.restores_called_off += 1
        log.info(
            "morph: restore called off with %d unit(s) not restored (%d swapped) - %s",
            left,
            self.morphed_units - staging_up,
            "; ".join(why),
        )
        self._refresh()
        return True

    def _continue_drain(self, block_tables: list[list[int]]) -> bool:
        """Move what can move out of the draining segment; once it is empty, release it and go on with the
        restore. True if the segment was released."""
        seg = self.draining
        if not self.pool.evacuate(seg, block_tables):
            return False  # no room elsewhere yet: the next iteration tries again
        self.pool.release_segment(seg)
        for s in self.swapped + self.stuck:
            if s.segment is seg:
                s.segment = None
        self.counters.kv_shrinks += 1
        self.draining = None
        self._refresh()
        self._stage_full(block_tables)
        return True

    def _stage_full(self, block_tables: list[list[int]]) -> None:
        unit = self.swapped[-1].unit
        staged = self.full_bytes[unit]
        if self.account.fits(staged):
            self._submit("up", unit, staged)
            return
        # Bounded: each pass releases one more added segment; the base pool (the first) is never drained.
        extra = next((s for s in reversed(self.pool.segments[1:]) if not s.draining), None)
        if extra is None:
            log.error(
                "morph: no room to stage full %s (%d bytes) with every added KV segment released; "
                "the restore is given up",
                self.units[unit].name,
                staged,
            )
            self.pending_up = 0
            return
        log.warning(
            "morph: no room to stage full %s yet; draining the KV segment at block %d too",
            self.units[unit].name,
            extra.base,
        )
        self.draining = extra
        self._continue_drain(block_tables)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
