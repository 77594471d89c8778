"""Continuous batching: which requests compute how many tokens this iteration.

Like vLLM v1, the scheduler knows only computed vs total tokens per request: a decode is "1 new token",
a prefill is "the rest of the prompt", chunked to the per-iteration token budget. Requests join and leave
the running batch every iteration. When a running request cannot get a block, the newest running request
is preempted (blocks freed, requeued at the front for recompute) and allocation is retried.
"""
from __future__ import annotations

import time
from collections import deque
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


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_size: int, max_num_tokens: int):
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, new_tokens: int) -> int:
        bs = self.pool.block_size
        return max(0, -(-(req.num_computed + new_tokens) // bs) - len(req.block_table))

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_table)
        req.block_table = []
        req.num_computed = 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def decode_rows(self) -> int:
        """Running requests whose next step is a decode (one new token)."""
        return sum(1 for r in self.running if r.num_tokens - r.num_computed == 1)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """`token_budget`: this iteration's tokens (default and at most max_num_tokens)."""
        out = SchedulerOutput()
        budget = self.max_num_tokens if token_budget is None else min(token_budget, self.max_num_tokens)
        # 1. Running requests first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            blocks = self.pool.allocate(need) if need else []
            while blocks is None:
                victim = self.running.pop()  # newest; never one already scheduled (those are before i)
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
        # 2. Admit waiting requests while there is room, unless we just had to preempt.
        now = time.monotonic()
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            blocks = self.pool.allocate(need)
            if blocks is None:
                out.admission_blocked = True
                break
            self.waiting.popleft()
            req.block_table.extend(blocks)
            req.status = Status.RUNNING
            if req.timings.scheduled is None:
                req.timings.scheduled = now
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and give its blocks back."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.block_table)
        req.block_table = []
        req.status = Status.FINISHED
