"""The engine: schedule -> forward -> sample -> emit, one iteration at a time, on one thread.

Callers (the Triton glue, the CLI, benchmarks) add requests from any thread; the engine thread owns
all mutable state (scheduler, KV pool, layer slots) and hands results back through callbacks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

import torch


from . import huge_pages
from .attention import AttentionPlan, SeqSlice
from .config import EngineConfig
from .controller import Load, parse_policy
from .errors import InvalidRequest, QueueFull
from .fragments import FragmentStore
from .head import head_mode
from .invariants import BlockChecker, binding_violations, head_violations, layer_bytes, memory_violations
from .kernel_numerics import KernelNumerics
from .kv_cache import KVPool
from .logprobs import log_probs, pick
from .manifest import Manifest
from .model import LlamaModel
from .morph import MorphManager
from .native_memory import pin_mmap_threshold
from .outputs import EngineStats, RequestOutput, RequestTimings
from .precision import HEAD_DYNAMIC
from .request import Request, streams_tpot
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .step_budget import StepBudget
from .structured import GrammarCompiler, MaskBatch, advance
from .streaming import OutputStream

log = logging.getLogger("morphserve.engine")

OnOutput = Callable[[RequestOutput], None]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        pin_mmap_threshold()
        torch.set_num_threads(config.threads())
        self.numerics = KernelNumerics(
            config.int4_activations, config.int4_prefill, config.lm_head_activations
        ).resolved()
        self.numerics.put_in_force()
        self.manifest = Manifest(config.fragment_dir)
        mc = self.manifest.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.store = FragmentStore(self.manifest, config.torch_dtype, config.weight_torch_dtype, config.huge_pages)
        from .tokenizer import Tokenizer

        self.tokenizer = Tokenizer(self.manifest)
        self._eos_ids = sorted(self.tokenizer.eos_token_ids)
        self._eos_index = torch.tensor(self._eos_ids, dtype=torch.long)
        self.model = LlamaModel(self.store, self.max_model_len)
        self.pool = KVPool(
            mc,
            config.block_size,
            config.kv_torch_dtype,
            config.device,
            config.huge_pages,
            config.enable_prefix_caching,
            config.kv_cache_reuse_across_morphs,
        )
        if config.huge_pages and config.device == "cpu" and (why := huge_pages.unavailable_reason()):
            log.warning(
                "weights and KV stay on 4 KiB pages: %s (decode steps are slower so: trtllm_backend/huge_pages.py)", why
            )
        self.scheduler = Scheduler(
            self.pool, config.max_batch_size, config.max_num_tokens, config.batch_scheduler_policy
        )
        self.step_budget = StepBudget(config.max_num_tokens, config.prefill_chunk_tpot_share * config.tpot_slo_s)
        self._admission_blocked = False  # the last schedule left the head of the queue waiting for KV blocks
        self._seen_preemptions = 0
        self._seen_evicted_misses = 0  # prefix-cache misses on evicted blocks at the last morph tick
        self.streams: dict[str, OutputStream] = {}
        self.requests: dict[str, Request] = {}
        self.on_logits: Callable[[str, torch.Tensor], None] | None = None  # test hook: each sampled row
        self.counters = EngineStats()
        self._last_violations: list[str] = []
        self._bindings_checked: tuple = (None, 0, [])  # (binding key, their bytes, their violations)
        self._blocks_checker = BlockChecker()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending = 0  # accepted, not yet finished (for the queue cap)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = EngineStats()
        self._compiler: GrammarCompiler | None = None  # built at the first structured request (~1 s)
        self._masks = MaskBatch()
        # The policy counts units: the layers, and the tied embedding / LM head where it morphs too.
        head = head_mode(config.lm_head_precision, self.manifest)
        units = mc.num_layers + (1 if head == HEAD_DYNAMIC else 0)
        policy = parse_policy(config.morph_policy, units, config.morph_overrides, config.tpot_slo_s, config.ttft_slo_s)
        # NOTE: the manager allocates the KV pool: whatever the budget leaves once the policy's weights are bound.
        self.morph = MorphManager(
            policy,
            manifest=self.manifest,
            store=self.store,
            slots=self.model.slots,
            pool=self.pool,
            shared_nbytes=self.model.shared_nbytes,
            counters=self.counters,
            head=self.model.head,
            head_mode=head,
            base_kv_blocks=config.base_kv_blocks,
            budget_bytes=config.memory_budget_bytes,
            forced=config.forced_morph_actions(),
        )
        self._publish_stats()

    # ---- public API (any thread) -----------------------------------------------------------------
    def add_request(
        self, prompt: str, params: SamplingParams, on_output: OnOutput, request_id: str | None = None
    ) -> str:
        if not self._accepting:
            raise QueueFull("engine is shutting down")
        prompt_ids = self._validate(prompt, params)
        matcher = self._grammars().matcher(params.guide) if params.guide is not None else None
        with self._lock:
            if self._pending - self._stats.running >= self.config.max_queue_size:
                raise QueueFull(f"waiting queue is full (max_queue_size={self.config.max_queue_size})")
            self._pending += 1
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, prompt_ids, params, RequestTimings(arrival=time.monotonic()), matcher=matcher)
        self._inbox.put(("add", req, on_output))
        self._wake.set()
        return rid

    def _grammars(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self.tokenizer.to_json(), self.manifest.config.vocab_size, self._eos_ids
                )
            return self._compiler

    def abort(self, request_id: str) -> bool:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()
        return True

    def abort_all(self) -> None:
        """Abort every request added so far (each gets its final "abort" output). With the engine thread running
        this happens before its next iteration; without it, now, on the calling thread."""
        self._inbox.put(("abort_all", None, None))
        self._wake.set()
        if self._thread is None:
            self._drain_inbox()

    def stats(self) -> EngineStats:
        """The latest snapshot, with the recent swap timings; reading it changes nothing."""
        snap = replace(self._stats)
        snap.swaps_timed, snap.swap_timings = self.morph.swap_log.snapshot()
        return snap

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="morphserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Stop admission, let running requests finish until the timeout, abort the rest, join."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._thread and self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join()
            self._thread = None
        self._drain_inbox()
        self._abort_all_now()
        self.morph.shutdown()

    def generate(self, prompt: str, params: SamplingParams) -> Iterator[RequestOutput]:
        """In-process streaming: yields each output piece; runs the engine loop on a thread if needed."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.add_request(prompt, params, q.put)
        if self._thread is None:
            self.run_until_idle()
        while True:
            out = q.get()
            yield out
            if out.finished:
                return

    def set_kernel_numerics(self, numerics: KernelNumerics) -> KernelNumerics:
        """This engine's kernel numerics from the next iteration on (benchmarks' A/B runs); returns the previous.
        Call between iterations, from the thread that steps the engine."""
        previous, self.numerics = self.numerics, numerics.resolved()
        self.numerics.put_in_force()
        return previous

    def run_until_idle(self) -> None:
        """Run iterations on the calling thread until every request is done (offline use, tests)."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is running; use callbacks or generate()")
        while True:
            self._drain_inbox()
            if not self.scheduler.has_work():
                return
            self.step()

    def settle_morph(self, timeout_s: float = 60.0) -> bool:
        """Run iterations on the calling thread until no morph action is in flight, queued, or forced for the
        current iteration (requests present are served meanwhile). False if still busy after `timeout_s`."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is running; settle_morph drives iterations itself")
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            if not self.morph.busy(self.counters.iterations):
                return True
            if time.monotonic() >= deadline:
                return False
            self.morph.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    # ---- validation (caller thread, before any memory is taken) ----------------------------------
    def _validate(self, prompt: str, params: SamplingParams) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("prompt", "must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", "must be SamplingParams")
        params.validate()
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt", "encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest("prompt", f"{len(ids)} tokens, the model context is {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"{params.max_tokens} + {len(ids)} prompt tokens exceeds the context of {self.max_model_len}",
            )
        capacity = self.pool.segments[0].num_blocks * self.config.block_size  # the pool never shrinks below it
        if len(ids) > capacity:
            raise InvalidRequest("prompt", f"{len(ids)} tokens do not fit the KV cache ({capacity} tokens)")
        if len(ids) + params.max_tokens > capacity:
            raise InvalidRequest(
                "max_tokens", f"{params.max_tokens} + {len(ids)} prompt tokens exceeds the KV cache ({capacity} tokens)"
            )
        return ids

    # ---- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            try:
                self._drain_inbox()
                if not self.scheduler.has_work():
                    self._publish_stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    # idle iterations still let the controller restore layers; a drain then moves cached
                    # prefix blocks, copies into KV made under inference mode
                    with torch.inference_mode():
                        self._morph_tick()
                    continue
                self.step()
            except Exception as exc:  # NOTE: a dead engine thread would leave every request hanging forever
                log.exception("iteration %d failed; failing the running requests", self.counters.iterations)
                for req in list(self.scheduler.running):
                    self._finish(req, "error", f"{type(exc).__name__}: {exc}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, cb = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.requests[item.request_id] = item
                self.streams[item.request_id] = OutputStream(item, self.tokenizer, cb)
                self.scheduler.add(item)
            elif kind == "abort" and item in self.requests:
                self._finish(self.requests[item], "abort")
            elif kind == "abort_all":
                self._abort_all_now()

    def _abort_all_now(self) -> None:
        for rid in list(self.requests):
            self._finish(self.requests[rid], "abort")

    def _morph_tick(self) -> None:
        """The iteration's Load, handed to the morph manager with the running requests' block tables."""
        s, p, m = self.scheduler, self.pool, self.morph
        now = time.monotonic()
        # NOTE: only the classes whose SLOs drive morphing (morph_priority_cutoff) are load: a burst of less
        # important work waits, or is preempted, rather than costing the others their precision.
        cutoff = self.config.morph_priority_cutoff
        waiting = s.waiting_within(cutoff)
        head = s.head_within(cutoff)
        driving = s.preemptions_within(cutoff)
        preemptions, self._seen_preemptions = driving - self._seen_preemptions, driving
        evicted = p.cache.stats.evicted_miss_blocks  # every class's: the cache is shared
        evicted_miss, self._seen_evicted_misses = evicted - self._seen_evicted_misses, evicted
        reserved = s.reserved_blocks()  # promised to running requests (guaranteed_no_evict): as good as used
        load = Load(
            now=now,
            waiting=waiting,
            head_wait_s=now - head.timings.arrival if head else 0.0,
            kv_usage=(p.num_used + reserved) / p.num_blocks if p.num_blocks else 0.0,
            kv_reserved_blocks=reserved,
            admission_blocked=self._admission_blocked,
            new_preemptions=preemptions,
            queue_blocks_short=s.queue_blocks_short(cutoff),
            tpot_s=streams_tpot([r for r in s.running if r.priority <= cutoff]),
            batch=len(s.running),
            evicted_miss_s=evicted_miss * p.block_size * (self.step_budget.per_token_s or 0.0),
        )
        m.on_iteration(load, self.counters.iterations, [r.block_table for r in s.running])
        p.cache.set_weights(
            tuple(u.unit for u in m.swapped + m.stuck)
        )  # KV is reused only under the weights that made it
        if self.config.check_invariants:
            self._note_violations(self.check_invariants())

    def check_invariants(self) -> list[str]:
        """The broken state invariants, one line each with the state that shows it (engine thread, or with no
        engine thread running)."""
        m, slots = self.morph, self.model.slots
        swapped = m.swapped_layers
        key = (tuple((id(s.weights), s.precision) for s in slots), tuple(swapped))
        if key != self._bindings_checked[0]:  # NOTE: bindings change only with a swap: checked then, not each time
            found = binding_violations(slots, self.manifest, swapped)
            self._bindings_checked = (key, layer_bytes(slots), found)
        _, layers, found = self._bindings_checked
        return (
            memory_violations(m.account, self.pool, layers)
            + self._blocks_checker.violations(self.pool, [r.block_table for r in self.scheduler.running])
            + found
            + head_violations(self.model, self.manifest, m.account, m.head_int8)
        )

    def _note_violations(self, found: list[str]) -> None:
        self.counters.invariant_violations += len(found)
        if found and found != self._last_violations:  # NOTE: once per new state, not every iteration
            for line in found:
                log.error("invariant violated at iteration %d: %s", self.counters.iterations, line)
        self._last_violations = found

    @torch.inference_mode()
    def step(self) -> None:
        """One iteration on the calling thread: take the requests added since the last one, advance morphing,
        schedule, run the model, sample and emit."""
        self.numerics.put_in_force()
        self._drain_inbox()
        self._morph_tick()
        sched = self.scheduler.schedule(self.step_budget.tokens(self.scheduler.decode_rows()))
        self.counters.preemptions = self.scheduler.num_preemptions
        self._admission_blocked = sched.admission_blocked
        if not sched.scheduled:
            self._publish_stats()
            return
        t_step = time.monotonic()
        ids, pos, seqs, rows, samplers = [], [], [], [], []
        scored: list[tuple[int, Request, int]] = []  # (flat row, request, position) whose next prompt token is scored
        start = 0
        for req, n in sched.scheduled:
            c = req.num_computed
            ids.extend(req.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            seqs.append(SeqSlice(start, n, c + n, req.block_table))
            if req.params.prompt_logprobs is not None:
                first = max(c, len(req.prompt_logprobs))  # a recompute after preemption scores nothing twice
                scored.extend((start + p - c, req, p) for p in range(first, min(c + n, len(req.prompt_ids) - 1)))
            start += n
            if c + n == req.num_tokens:
                rows.append(start - 1)
                samplers.append(req)
        plan = AttentionPlan(self.pool, seqs)
        # NOTE: every row samples in a pure decode step: no gather of the rows (a torch call that misses the
        # caches right after the layers streamed the weights through them).
        all_rows = rows + [r for r, _, _ in scored]
        logit_rows = None if all_rows == list(range(len(ids))) else torch.tensor(all_rows, dtype=torch.long)
        logits = self.model.forward(torch.tensor(ids), torch.tensor(pos), plan, logit_rows)
        if scored:
            self._score_prompt_tokens(logits[len(rows) :], scored)
            logits = logits[: len(rows)]
        for req, n in sched.scheduled:
            req.num_computed += n
            self.counters.prompt_tokens += n if req.num_output == 0 else 0
            self.pool.cache.cache_computed(req)
        if samplers:
            wants = [r for r, req in enumerate(samplers) if req.params.logprobs is not None]
            logp = log_probs(logits[wants]) if wants else None  # NOTE: the raw distribution, before any mask
            self._mask_early_eos(logits, samplers)
            guided = [r for r, req in enumerate(samplers) if req.matcher is not None]
            self._masks.apply(logits, guided, [samplers[r].matcher for r in guided])
            if self.on_logits is not None:
                for r, req in enumerate(samplers):
                    self.on_logits(req.request_id, logits[r])
            tokens = sample(
                logits,
                [r.params for r in samplers],
                [r.generator for r in samplers],
                [r.output_ids if r.params.penalized else [] for r in samplers],
            )
            int4 = self.num_quantized_layers()
            now = time.monotonic()
            picked = (
                dict(zip(wants, pick(logp, [tokens[r] for r in wants], [samplers[r].params.logprobs for r in wants])))
                if wants
                else {}
            )
            for r, (req, tok) in enumerate(zip(samplers, tokens)):
                req.token_ids.append(tok)
                self.counters.generation_tokens += 1
                req.note_token_time(now)
                if req.timings.first_token is None:
                    req.timings.first_token = now
                req.timings.last_token = now
                if req.matcher is not None:
                    advance(req.matcher, tok)
                lp = picked.get(r)
                if lp is not None:
                    req.cumulative_logprob += lp.logprob
                reason = self.streams[req.request_id].add_token(tok, int4, lp)
                if reason:
                    self._finish(req, reason)
        decodes = sum(1 for _, n in sched.scheduled if n == 1)
        self.step_budget.observe(sched.num_tokens, decodes, time.monotonic() - t_step)
        self.counters.iterations += 1
        self._publish_stats()

    @staticmethod
    def _score_prompt_tokens(logits: torch.Tensor, scored: list[tuple[int, Request, int]]) -> None:
        """Row i of `logits` is position p of its request: the logprob of prompt token p + 1."""
        entries = pick(
            log_probs(logits),
            [req.prompt_ids[p + 1] for _, req, p in scored],
            [req.params.prompt_logprobs for _, req, _ in scored],
        )
        for (_, req, _), entry in zip(scored, entries):
            req.prompt_logprobs.append(entry)

    def _mask_early_eos(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        rows = [r for r, req in enumerate(reqs) if req.params.ignore_eos or req.num_output < req.params.min_tokens]
        if len(rows) == len(reqs):  # every row: one column fill of the end-of-sequence ids
            logits.index_fill_(1, self._eos_index, float("-inf"))
        elif rows:  # one indexed write for the rows that need it
            logits[torch.tensor(rows, dtype=torch.long)[:, None], self._eos_index[None, :]] = float("-inf")

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        stream = self.streams.pop(req.request_id)
        stream.kv_reuse = req.kv_reuse()  # while it still holds its blocks
        self.scheduler.finish(req)
        req.timings.finished = time.monotonic()
        del self.requests[req.request_id]
        with self._lock:
            self._pending -= 1
        stream.finish(reason, error)

    def num_quantized_layers(self) -> int:
        return self.morph.int4_layers

    def _publish_stats(self) -> None:
        """Snapshot for other threads (replaced whole, never mutated after publication)."""
        c, p, s = self.counters, self.pool, self.scheduler
        total, free, cached = p.num_blocks, p.num_free, p.num_evictable  # sums over the segments: read once
        hits = p.cache.stats
        self._stats = EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_total=total,
            kv_blocks_used=total - free - cached,
            kv_blocks_free=free + cached,
            kv_blocks_cached=cached,
            kv_usage=(total - free - cached) / total if total else 0.0,
            prefix_cache_hit_blocks=hits.hit_blocks,
            prefix_cache_miss_blocks=hits.miss_blocks,
            prefix_cache_reused_tokens=hits.reused_tokens,
            prefix_cache_evictions=hits.evictions,
            prefix_cache_evicted_miss_blocks=hits.evicted_miss_blocks,
            waiting_by_priority=s.waiting_by_priority(),
            preemptions=s.num_preemptions,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            iterations=c.iterations,
            int4_layers=self.num_quantized_layers(),
            lm_head_int8=int(self.morph.head_int8),
            swaps_down=c.swaps_down,
            swaps_up=c.swaps_up,
            kv_grows=c.kv_grows,
            kv_shrinks=c.kv_shrinks,
            swap_failures=c.swap_failures,
            restores_called_off=c.restores_called_off,
            invariant_violations=c.invariant_violations,
            memory_budget_bytes=self.morph.account.budget,
            memory_used_bytes=self.morph.account.used,
        )
