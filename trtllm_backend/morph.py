"""Runtime morphing: quantized layer swapping plus pressure-aware KV cache resizing.

Runs as an engine iteration hook, so every state change happens between two iterations on the engine
thread. Reading and preparing a fragment happens on a background thread while the engine keeps stepping;
only the rebinding (and the KV segment change it pays for) happens on the engine thread.

Swap down, one layer at a time: stage the INT4 fragment (in the reserve) -> rebind the slot -> drop the
full fragment -> the freed bytes become a new KV segment of whole blocks.
Restore, most recent swap first: stop allocating from that layer's segment, migrate its live blocks into
free blocks elsewhere, release it -> stage the full fragment in the released bytes -> rebind.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .controller import INT4, Action, Controller, MorphPolicy, Signals
from .errors import FragmentError
from .kv_cache import KVSegment
from .manifest import FULL
from .memory import MemoryAccount

if TYPE_CHECKING:
    from .engine import LLMEngine

log = logging.getLogger("morphserve.morph")


@dataclass(slots=True)
class _Job:
    kind: str  # "down" or "up"
    layer: int
    future: Future
    staged_bytes: int
    started: float


@dataclass(slots=True)
class _Swapped:
    layer: int
    segment: KVSegment | None  # the KV blocks this swap paid for


@dataclass
class MorphManager:
    engine: "LLMEngine"
    policy: MorphPolicy
    budget_bytes: int | None = None
    swapped: list[_Swapped] = field(default_factory=list)  # a stack: restores pop from the end
    failed: set[int] = field(default_factory=set)
    pending_down: int = 0
    pending_up: int = 0
    job: _Job | None = None
    draining: _Swapped | None = None
    peak_used: int = 0
    timings: deque = field(default_factory=deque)  # (prepare_s, apply_s) not yet reported

    def __post_init__(self):
        e = self.engine
        m = e.manifest
        self.controller = Controller(self.policy)
        self.order = m.swap_order()
        self.quantizable = all(INT4 in m.precisions(i) for i in range(m.num_layers))
        self.reserve = max((m.fragment(i, INT4)["bytes"] for i in range(m.num_layers)), default=0) if self.quantizable else 0
        # Resident bytes of each full-precision layer, known exactly before anything is swapped.
        self.full_bytes = [slot.weights.nbytes for slot in e.model.slots]
        self.account = MemoryAccount(budget=0, reserve=self.reserve)
        self._refresh()
        default_budget = self.account.used + self.reserve
        self.account.budget = self.budget_bytes or default_budget
        if self.account.budget < default_budget:
            raise ValueError(
                f"memory_budget_bytes: {self.account.budget} is below the full-precision model plus the base KV pool "
                f"plus one staging fragment ({default_budget} bytes)"
            )
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="morphserve-fragments")
        self._seen_preemptions = 0
        self._lock = threading.Lock()
        if (self.policy.dynamic or self.policy.static_int4_layers) and not self.quantizable:
            if self.policy.static_int4_layers:
                raise FragmentError(f"morph_policy {self.policy.name}: the fragment set has no INT4 fragments (build them with engines.quantize_awq)")
            log.warning("no INT4 fragments in %s: morphing is off, serving at full precision", m.dir)
        # A budget above the default is KV memory from the start.
        self._grow_kv(force_segment=False)
        for _ in range(self.policy.static_int4_layers):
            self._swap_down_now()

    # ---- accounting -----------------------------------------------------------------------------
    def _refresh(self) -> None:
        e, a = self.engine, self.account
        a.shared = e.model.shared_nbytes
        a.layers = sum(s.weights.nbytes for s in e.model.slots)
        a.kv = e.pool.nbytes
        a.staged = self.job.staged_bytes if self.job else 0
        self.peak_used = max(self.peak_used, a.used)
        if a.budget and a.used > a.budget:  # never expected: every allocation is checked first
            raise AssertionError(f"memory account {a.used} exceeds the budget {a.budget}")

    def _grow_kv(self, force_segment: bool = True) -> KVSegment | None:
        n = self.engine.pool.blocks_for_bytes(self.account.available)
        if n <= 0:
            return None
        seg = self.engine.pool.add_segment(n)
        self.engine.counters.kv_grows += 1
        self._refresh()
        return seg

    @property
    def int4_layers(self) -> int:
        return len(self.swapped)

    def blocks_per_layer(self) -> int:
        m = self.engine.manifest
        freed = self.full_bytes[0] - (m.fragment(0, INT4)["bytes"] if self.quantizable else 0)
        return max(0, freed // self.engine.pool.bytes_per_block)

    # ---- the iteration hook (engine thread) -----------------------------------------------------
    def on_iteration(self, engine: "LLMEngine") -> None:
        if self.job and self.job.future.done():
            self._finish_job()
        if self.draining is not None:
            self._continue_drain()
        if self.job is None and self.draining is None and not (self.pending_down or self.pending_up) and self.quantizable:
            action = self.controller.decide(self._signals(), engine.counters.iterations)
            if action:
                self._accept(action)
        if self.job is None and self.draining is None:
            if self.pending_down:
                self._start_down()
            elif self.pending_up:
                self._start_up()
        self._refresh()

    def _accept(self, action: Action) -> None:
        if action.kind == "down":
            k = min(action.layers, len(self._candidates()))
            if k:
                self.pending_down = k
                log.info("morph: swap %d layer(s) to INT4 (%d now) - %s", k, self.int4_layers, action.reason)
        else:
            k = min(action.layers, self.int4_layers)
            if k:
                self.pending_up = k
                log.info("morph: restore %d layer(s) to full precision (%d INT4 now) - %s", k, self.int4_layers, action.reason)

    def _signals(self) -> Signals:
        e = self.engine
        s, p = e.scheduler, e.pool
        now = time.monotonic()
        head = s.waiting[0] if s.waiting else None
        short = 0
        if head is not None:
            need = -(-(head.num_tokens - head.num_computed) // p.block_size)
            short = max(0, need - p.num_allocatable)
        top = self.swapped[-1].segment if self.swapped else None
        remaining = p.num_blocks - (top.num_blocks if top else 0)
        preempt = s.num_preemptions - self._seen_preemptions
        self._seen_preemptions = s.num_preemptions
        sched = getattr(e, "last_schedule", None)
        return Signals(
            now=now,
            waiting=len(s.waiting),
            head_wait_s=now - head.timings.arrival if head else 0.0,
            kv_usage=p.num_used / p.num_blocks if p.num_blocks else 0.0,
            admission_blocked=bool(sched and sched.admission_blocked),
            new_preemptions=preempt,
            head_blocks_short=short,
            blocks_per_layer=self.blocks_per_layer(),
            int4_layers=self.int4_layers,
            usage_after_shrink=(p.num_used / remaining) if self.swapped and remaining > 0 else 1.0,
            recent_ttft_s=e.recent_ttft(),
        )

    def _candidates(self) -> list[int]:
        done = {s.layer for s in self.swapped}
        return [i for i in self.order if i not in done and i not in self.failed]

    # ---- swap down ------------------------------------------------------------------------------------
    def _start_down(self) -> None:
        candidates = self._candidates()
        if not candidates:
            self.pending_down = 0
            return
        layer = candidates[0]
        staged = self.engine.manifest.fragment(layer, INT4)["bytes"]
        if not self.account.fits(staged):
            log.warning("morph: no room to stage layer %d (%d bytes); waiting", layer, staged)
            return
        fut = self.executor.submit(self.engine.store.load_layer, layer, INT4)
        self.job = _Job("down", layer, fut, staged, time.monotonic())
        self._refresh()

    def _swap_down_now(self) -> None:
        """Synchronous swap (static policies at load)."""
        self.pending_down = 1
        self._start_down()
        if self.job is not None:
            self.job.future.result()
            self._finish_job()

    def _finish_job(self) -> None:
        job, self.job = self.job, None
        prepare = time.monotonic() - job.started
        try:
            weights = job.future.result()
        except (FragmentError, OSError, ValueError, KeyError) as err:
            self.engine.counters.swap_failures += 1
            log.error("morph: cannot load layer %d for %s: %s; the layer stays where it is", job.layer, job.kind, err)
            if job.kind == "down":
                self.failed.add(job.layer)
                self.pending_down = max(0, self.pending_down - 1)
            else:
                self.pending_up = 0
            self._refresh()
            return
        t0 = time.monotonic()
        slot = self.engine.model.slots[job.layer]
        if job.kind == "down":
            old = slot.bind(weights, INT4)
            del old, weights  # the full fragment's memory goes back now
            self._refresh()
            seg = self._grow_kv()
            self.swapped.append(_Swapped(job.layer, seg))
            self.engine.counters.swaps_down += 1
            self.pending_down -= 1
        else:
            old = slot.bind(weights, FULL)
            del old, weights
            self.swapped.pop()
            self.engine.counters.swaps_up += 1
            self.pending_up -= 1
            self._refresh()
            self._grow_kv()  # the INT4 fragment's bytes are free again: keep the reserve, use the rest
        apply = time.monotonic() - t0
        with self._lock:
            self.timings.append((prepare, apply))
        log.info("morph: layer %d -> %s (prepare %.1f ms, apply %.2f ms, KV %d blocks, %d INT4 layers)",
                 job.layer, INT4 if job.kind == "down" else FULL, prepare * 1e3, apply * 1e3, self.engine.pool.num_blocks, self.int4_layers)

    # ---- restore -----------------------------------------------------------------------------------
    def _start_up(self) -> None:
        if not self.swapped:
            self.pending_up = 0
            return
        top = self.swapped[-1]
        if top.segment is not None:
            top.segment.draining = True
            self.draining = top
            self._continue_drain()
        else:
            self._stage_full(top.layer)

    def _continue_drain(self) -> None:
        top = self.draining
        seg = top.segment
        pool = self.engine.pool
        for req in self.engine.scheduler.running:
            table = req.block_table
            for i, b in enumerate(table):
                if seg.owns(b):
                    dst = pool.allocate(1)
                    if dst is None:
                        return  # no room elsewhere yet: keep draining next iteration
                    pool.copy_block(b, dst[0])
                    pool.free([b])
                    table[i] = dst[0]
        if len(seg.free) != seg.num_blocks:
            return
        pool.release_segment(seg)
        top.segment = None
        self.engine.counters.kv_shrinks += 1
        self.draining = None
        self._refresh()
        self._stage_full(top.layer)

    def _stage_full(self, layer: int) -> None:
        staged = self.full_bytes[layer]
        if not self.account.fits(staged):
            # Release more KV room: the next-most-recent segments are drained in later iterations.
            log.warning("morph: no room to stage full layer %d yet", layer)
            return
        fut = self.executor.submit(self.engine.store.load_layer, layer, FULL)
        self.job = _Job("up", layer, fut, staged, time.monotonic())
        self._refresh()

    # ---- reporting ---------------------------------------------------------------------------------
    def drain_timings(self) -> list[tuple[float, float]]:
        with self._lock:
            out = list(self.timings)
            self.timings.clear()
        return out

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
