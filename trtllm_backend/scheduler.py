"""Continuous batching: which requests compute how many tokens this iteration.

Like vLLM v1, the scheduler knows only computed vs total tokens per request: a decode is "1 new token",
a prefill is "the rest of the prompt", chunked to the per-iteration token budget. Requests join and leave
the running batch every iteration. When a running request cannot get a block, the least important running
request (the newest of its priority) is preempted (blocks freed, requeued for recompute) and allocation is
retried.

Priorities (SamplingParams.priority, lower is more important): both queues are kept in (priority, arrival)
order, so the waiting head is the most important oldest request and preemption takes from the running tail. A
waiting request that finds no room (blocks or batch slots) preempts running requests of a lower priority, never
of its own or a higher one. A running request's prefill chunks wait while a more important request waits
to be admitted; decodes never wait.

A request admitted with nothing computed first takes the longest cached prefix of its tokens from the pool's
prefix cache: those tokens count as computed and are never prefilled (prefix_cache.py).

Capacity policies (TensorRT-LLM's `batch_scheduler_policy`): MAX_UTILIZATION admits a request when its next chunk
fits and preempts when running requests outgrow the pool (vLLM's way). GUARANTEED_NO_EVICT (TensorRT-LLM's
default) admits a request only when the pool can also hold every running request, and this one, up to prompt +
max_tokens: a started request is never preempted for KV (only a shrinking pool or a more important request can
still take its blocks). The blocks so promised count as used wherever KV pressure is judged (`reserved_blocks`).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

from .kv_cache import KVPool
from .request import Request, Status


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    admission_blocked: bool = False  # the head of the queue waited for lack of KV blocks

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


MAX_UTILIZATION = "max_utilization"
GUARANTEED_NO_EVICT = "guaranteed_no_evict"
CAPACITY_POLICIES = (MAX_UTILIZATION, GUARANTEED_NO_EVICT)


def check_capacity_policy(policy: str) -> None:
    """Raise ValueError naming the parameter unless `policy` is one of CAPACITY_POLICIES."""
    if policy not in CAPACITY_POLICIES:
        raise ValueError(f"batch_scheduler_policy must be one of {', '.join(CAPACITY_POLICIES)}, got {policy!r}")


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_size: int, max_num_tokens: int, policy: str = MAX_UTILIZATION):
        check_capacity_policy(policy)
        self.pool = pool
        self.guaranteed = policy == GUARANTEED_NO_EVICT
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: list[Request] = []  # (priority, arrival) order: the head is admitted first
        self.running: list[Request] = []  # the same order: the tail is preempted first
        self.num_preemptions = 0
        self.preemptions_by_priority: Counter = Counter()

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=_rank)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, new_tokens: int) -> int:
        bs = self.pool.block_size
        return max(0, -(-(req.num_computed + new_tokens) // bs) - len(req.block_table))

    def _blocks_to_finish(self, req: Request) -> int:
        """Blocks the request needs beyond those it holds to reach prompt + max_tokens (the engine admits no request
        whose sum exceeds the context)."""
        final = len(req.prompt_ids) + req.params.max_tokens
        return max(0, -(-final // self.pool.block_size) - len(req.block_table))

    def reserved_blocks(self) -> int:
        """GUARANTEED_NO_EVICT: blocks promised to running requests beyond those they hold (0 under MAX_UTILIZATION)."""
        return sum(self._blocks_to_finish(r) for r in self.running) if self.guaranteed else 0

    def _preempt(self, req: Request) -> None:
        self._drop_blocks(req)
        req.status = Status.WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_priority[req.priority] += 1
        self.add(req)  # ahead of every later arrival of its priority

    def _drop_blocks(self, req: Request) -> None:
        """Give the request's blocks back (its cached full blocks stay cached: a recompute finds them again)."""
        self.pool.free(req.block_table)
        req.block_table = []
        req.num_computed = 0
        req.block_names = []

    def _reuse_cached_prefix(self, req: Request) -> tuple[int, int]:
        """Start a request with nothing computed from the longest cached prefix of its tokens; returns the full
        blocks looked up and the missed ones the cache had evicted."""
        cache = self.pool.cache
        blocks, names, looked, evicted = cache.match(req.token_ids)
        req.block_table = blocks
        req.block_names = names
        req.num_computed = len(blocks) * self.pool.block_size
        req.cache_version = cache.weights_version
        return looked, evicted

    def waiting_by_priority(self) -> tuple[tuple[int, int], ...]:
        """(priority, waiting requests) for each class waiting, most important first."""
        return tuple(Counter(r.priority for r in self.waiting).items())  # the queue's order: sorted already

    def waiting_within(self, priority: int) -> int:
        """Waiting requests of this priority or a more important one (the head of the queue first)."""
        return bisect.bisect_right(self.waiting, priority, key=lambda r: r.priority)

    def head_within(self, priority: int) -> Request | None:
        """The head of the queue, if it is of this priority or a more important one (else None)."""
        return self.waiting[0] if self.waiting and self.waiting[0].priority <= priority else None

    def queue_blocks_short(self, priority: int) -> int:
        """KV blocks the waiting queue (as `waiting_within`, as many requests as free batch slots, the head first)
        lacks to be admitted with their whole prompts: the blocks their uncomputed tokens need (under
        GUARANTEED_NO_EVICT: all they may grow to) beyond what the pool can hand out now (cached blocks nobody holds
        count as free, blocks promised to running requests do not); 0 if none waits. What a swap down must pay for
        to admit them (controller.Controller.decide): sized for the head alone, a burst's queue was admitted two
        layers at a time, each step waiting for pressure anew (docs/architecture.md, "Why the thresholds")."""
        slots = max(0, self.max_batch_size - len(self.running))
        queue = self.waiting[: min(self.waiting_within(priority), slots)]
        if not queue:
            return 0
        need = sum(
            self._blocks_to_finish(r) if self.guaranteed else self._blocks_needed(r, r.num_tokens - r.num_computed)
            for r in queue
        )
        return max(0, need - (self.pool.num_allocatable - self.reserved_blocks()))

    def preemptions_within(self, priority: int) -> int:
        """Preemptions so far of requests of this priority or a more important one."""
        return sum(n for p, n in self.preemptions_by_priority.items() if p <= priority)

    def decode_rows(self) -> int:
        """Running requests whose next step is a decode (one new token)."""
        return sum(1 for r in self.running if r.num_tokens - r.num_computed == 1)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """`token_budget`: this iteration's tokens (default and at most max_num_tokens)."""
        out = SchedulerOutput()
        budget = self.max_num_tokens if token_budget is None else min(token_budget, self.max_num_tokens)
        # 1. Running requests first, most important and oldest first. A prefill chunk of a running request less
        #    important than the head of the queue waits until that head is admitted (decodes never wait): else an
        #    interactive prompt queues behind a batch prompt's chunks, which may fill the budget for many steps.
        head = self.waiting[0].priority if self.waiting else None
        yielded: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            if head is not None and req.priority > head and req.num_tokens - req.num_computed > 1:
                yielded.append(req)
                i += 1
                continue
            need = self._blocks_needed(req, n)
            blocks = self.pool.allocate(need) if need else []
            while blocks is None:
                victim = self.running.pop()  # least important, newest; never one before i (scheduled or yielded)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                blocks = self.pool.allocate(need)
            if blocks is None:
                break
            req.block_table.extend(blocks)
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        # 2. Admit waiting requests more important than those that yielded, then the yielded chunks, then the
        #    rest of the queue while there is room, unless a running request just had to be preempted.
        starved = bool(out.preempted)
        if yielded:
            budget = self._admit(out, budget, starved, more_important_than=yielded[0].priority)
            budget = self._continue_prefills(out, budget, yielded)
        self._admit(out, budget, starved)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, starved: bool, more_important_than: int | None = None) -> int:
        """Admit the head of the queue while there is room and budget (only requests of a priority below
        `more_important_than`, if given); returns the budget left."""
        now = time.monotonic()
        while self.waiting and not starved and budget > 0:
            req = self.waiting[0]
            if more_important_than is not None and req.priority >= more_important_than:
                break
            looked, evicted = self._reuse_cached_prefix(req) if req.num_computed == 0 else (0, 0)
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            blocks = self._room_for(req, need)
            while blocks is None and self.running and self.running[-1].priority > req.priority:
                victim = self.running.pop()  # less important: it makes room (its scheduled tokens are given back)
                for j, (r, k) in enumerate(out.scheduled):
                    if r is victim:
                        del out.scheduled[j]
                        budget += k
                        break
                self._preempt(victim)
                out.preempted.append(victim)
                blocks = self._room_for(req, need)
            if blocks is None:
                out.admission_blocked = len(self.running) < self.max_batch_size
                self._drop_blocks(req)  # the reused prefix goes back to the cache until the next try
                break
            self.waiting.pop(0)
            hit = len(req.block_table)
            self.pool.cache.count_lookup(hit, looked, evicted)
            if req.timings.scheduled is None:
                req.timings.scheduled = now
                req.reused_blocks, req.missed_blocks = hit, looked - hit
                req.reused_tokens = req.num_computed
            req.block_table.extend(blocks)
            req.status = Status.RUNNING
            bisect.insort(self.running, req, key=_rank)
            out.scheduled.append((req, n))
            budget -= n
        return budget

    def _continue_prefills(self, out: SchedulerOutput, budget: int, yielded: list[Request]) -> int:
        """The budget left to the prefill chunks that yielded to the queue's head, in their order; one short of
        blocks waits for the next iteration (it preempts nobody: it is not the most important work)."""
        for req in yielded:
            if budget <= 0:
                break
            if req.status != Status.RUNNING:  # preempted since, to admit a more important request
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            blocks = self.pool.allocate(need) if need else []
            if blocks is None:
                continue
            req.block_table.extend(blocks)
            out.scheduled.append((req, n))
            budget -= n
        return budget

    def _room_for(self, req: Request, need: int) -> list[int] | None:
        """`need` blocks for `req` joining the batch, or None (no blocks, no batch slot, or, under
        GUARANTEED_NO_EVICT, no room for it and every running request to finish)."""
        if len(self.running) >= self.max_batch_size:
            return None
        if self.guaranteed and self._blocks_to_finish(req) > self.pool.num_allocatable - self.reserved_blocks():
            return None
        return self.pool.allocate(need)

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and give its blocks back."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._drop_blocks(req)
        req.status = Status.FINISHED


def _rank(req: Request) -> tuple[int, float]:
    return req.priority, req.timings.arrival
