"""Prometheus metrics through Triton's `pb_utils.MetricFamily` (served on the metrics port, :8002).

Gauges and engine counters are refreshed from `engine.stats()` by the glue's metrics thread; request
histograms and `morphserve_requests_total` are updated when a request finishes. `pb_utils` is passed in, so
this module imports without Triton (unit tests hand it a fake).
"""

from __future__ import annotations

from typing import Any

from ..outputs import EngineStats, RequestTimings

# Seconds. TTFT/queue time span a quiet server (ms) to a burst on two cores (tens of seconds).
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]
SWAP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]

REQUEST_STATUSES = ("success", "error", "cancelled")


class _Gauge:
    """A gauge that is only written when its value changes (each write is an IPC call to tritonserver)."""

    __slots__ = ("metric", "last")

    def __init__(self, metric: Any):
        self.metric = metric
        self.last = None

    def set(self, value: float) -> None:
        if value != self.last:
            self.metric.set(value)
            self.last = value


class _Counter:
    """A Prometheus counter fed from a cumulative engine counter: increments by the difference."""

    __slots__ = ("metric", "last")

    def __init__(self, metric: Any):
        self.metric = metric
        self.last = 0

    def advance(self, total: int) -> None:
        if total > self.last:
            self.metric.increment(total - self.last)
        self.last = total  # NOTE: a smaller total means a new engine; start counting from it


class TritonMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str], kv_capacity_blocks: int):
        self._pb = pb_utils
        self._labels = dict(labels)
        # NOTE: keep every family: a collected MetricFamily makes every later update of its metrics fail.
        self.families: dict[str, Any] = {}
        gauge, counter, hist = (
            pb_utils.MetricFamily.GAUGE,
            pb_utils.MetricFamily.COUNTER,
            pb_utils.MetricFamily.HISTOGRAM,
        )

        self.requests = self._gauges(
            "morphserve_requests",
            "Requests by state (active = held by the model)",
            "state",
            ("active", "waiting", "scheduled"),
        )
        self.kv_blocks = self._gauges(
            "morphserve_kv_cache_blocks",
            "KV-cache blocks (free includes cached: cached prefix blocks no request holds)",
            "type",
            ("max", "used", "free", "cached"),
        )
        self.kv_usage = _Gauge(self._single("morphserve_kv_cache_usage_ratio", "Used / max KV-cache blocks", gauge))
        self.int4_layers = _Gauge(self._single("morphserve_int4_layers", "Decoder layers running quantized", gauge))
        self.lm_head_int8 = _Gauge(
            self._single(
                "morphserve_lm_head_int8", "1 while the tied embedding / LM head runs from its INT8 fragment", gauge
            )
        )
        self.kv_capacity = _Gauge(
            self._single(
                "morphserve_kv_capacity_blocks", "KV-cache blocks of the configured pool at full precision", gauge
            )
        )
        self.memory = self._gauges(
            "morphserve_memory_bytes", "Memory budget and resident bytes", "type", ("budget", "used")
        )

        self.preemptions = _Counter(self._single("morphserve_preemptions_total", "Preempted requests", counter))
        self.prompt_tokens = _Counter(
            self._single("morphserve_prompt_tokens_total", "Prefilled prompt tokens", counter)
        )
        self.generation_tokens = _Counter(
            self._single("morphserve_generation_tokens_total", "Generated tokens", counter)
        )
        self.requests_total = self._labelled(
            "morphserve_requests_total", "Finished requests by status", counter, "status", REQUEST_STATUSES
        )
        swaps = self._labelled(
            "morphserve_layer_swaps_total",
            "Unit swaps (down = layers to INT4, the LM head to INT8)",
            counter,
            "direction",
            ("down", "up"),
        )
        self.swaps = {k: _Counter(m) for k, m in swaps.items()}
        resizes = self._labelled(
            "morphserve_kv_resizes_total", "KV-cache resizes", counter, "direction", ("grow", "shrink")
        )
        self.resizes = {k: _Counter(m) for k, m in resizes.items()}
        self.swap_failures = _Counter(self._single("morphserve_swap_failures_total", "Failed layer swaps", counter))
        self.restores_called_off = _Counter(
            self._single(
                "morphserve_restores_called_off_total",
                "Restores called off because pressure returned mid-restore (units not yet restored stay quantized)",
                counter,
            )
        )
        self.invariant_violations = _Counter(
            self._single(
                "morphserve_invariant_violations_total",
                "Broken engine invariants seen (one per line per iteration)",
                counter,
            )
        )

        lookups = self._labelled(
            "morphserve_prefix_cache_blocks_total",
            "Full prompt blocks looked up in the prefix cache at admission, by result",
            counter,
            "result",
            ("hit", "miss"),
        )
        self.prefix_lookups = {k: _Counter(m) for k, m in lookups.items()}
        self.prefix_reused_tokens = _Counter(
            self._single(
                "morphserve_prefix_cache_reused_tokens_total",
                "Prompt tokens not prefilled thanks to the prefix cache",
                counter,
            )
        )
        self.prefix_evictions = _Counter(
            self._single(
                "morphserve_prefix_cache_evictions_total",
                "Cached prefix blocks evicted (least recently used first)",
                counter,
            )
        )
        self.prefix_evicted_misses = _Counter(
            self._single(
                "morphserve_prefix_cache_evicted_miss_blocks_total",
                "Full prompt blocks missed because the cache had evicted them: what a bigger KV pool would have served",
                counter,
            )
        )
        self.prefix_hit_rate = _Gauge(
            self._single(
                "morphserve_prefix_cache_hit_rate",
                "Prefix cache hits / full prompt blocks looked up, since start",
                gauge,
            )
        )
        # Per priority class (the priority input): created when a class is first seen.
        self._waiting_family = self._family(
            "morphserve_requests_waiting_by_priority", "Waiting requests by priority", gauge
        )
        self._class_ttft_family = self._family(
            "morphserve_priority_time_to_first_token_seconds", "Time to first token by priority", hist
        )
        self._class_queue_family = self._family(
            "morphserve_priority_request_queue_time_seconds", "Time from arrival to first schedule by priority", hist
        )
        self._classes: dict[int, tuple[_Gauge, Any, Any]] = {}
        self.ttft = self._single("morphserve_time_to_first_token_seconds", "Time to first token", hist, LATENCY_BUCKETS)
        self.tpot = self._single(
            "morphserve_time_per_output_token_seconds", "Time per output token after the first", hist, TPOT_BUCKETS
        )
        self.e2e = self._single(
            "morphserve_e2e_request_latency_seconds", "End-to-end request latency", hist, E2E_BUCKETS
        )
        self.queue_time = self._single(
            "morphserve_request_queue_time_seconds", "Time from arrival to first schedule", hist, LATENCY_BUCKETS
        )
        self.swap_prepare = self._single(
            "morphserve_swap_prepare_seconds", "Layer swap preparation (background)", hist, SWAP_BUCKETS
        )
        self.swap_apply = self._single(
            "morphserve_swap_apply_seconds", "Layer swap application (iteration boundary)", hist, SWAP_BUCKETS
        )
        self.kv_capacity.set(kv_capacity_blocks)
        self._swaps_seen = 0  # EngineStats.swaps_timed at the last update: each swap is observed once

    def _class(self, priority: int) -> tuple[_Gauge, Any, Any]:
        """(waiting gauge, TTFT histogram, queue-time histogram) of one priority class."""
        if priority not in self._classes:
            labels = {**self._labels, "priority": str(priority)}
            self._classes[priority] = (
                _Gauge(self._waiting_family.Metric(labels=labels)),
                self._class_ttft_family.Metric(labels=labels, buckets=LATENCY_BUCKETS),
                self._class_queue_family.Metric(labels=labels, buckets=LATENCY_BUCKETS),
            )
        return self._classes[priority]

    def _family(self, name: str, doc: str, kind: Any) -> Any:
        family = self._pb.MetricFamily(name=name, description=doc, kind=kind)
        self.families[name] = family
        return family

    def _single(self, name: str, doc: str, kind: Any, buckets: list[float] | None = None) -> Any:
        family = self._family(name, doc, kind)
        if buckets is not None:
            return family.Metric(labels=self._labels, buckets=buckets)
        return family.Metric(labels=self._labels)

    def _labelled(self, name: str, doc: str, kind: Any, key: str, values: tuple[str, ...]) -> dict[str, Any]:
        family = self._family(name, doc, kind)
        return {v: family.Metric(labels={**self._labels, key: v}) for v in values}

    def _gauges(self, name: str, doc: str, key: str, values: tuple[str, ...]) -> dict[str, _Gauge]:
        labelled = self._labelled(name, doc, self._pb.MetricFamily.GAUGE, key, values)
        return {v: _Gauge(m) for v, m in labelled.items()}

    # --- updates ----------------------------------------------------------------------------------------------
    def update(self, stats: EngineStats, active: int) -> None:
        """From the metrics thread, with a fresh engine.stats() snapshot (reading one changes nothing)."""
        # NOTE: counters first: a scrape between the two halves then never sees a gauge ahead of the counters
        # that explain it (int4_layers back at 0 with the restore not yet counted broke a CI run).
        self.preemptions.advance(stats.preemptions)
        self.prompt_tokens.advance(stats.prompt_tokens)
        self.generation_tokens.advance(stats.generation_tokens)
        self.swaps["down"].advance(stats.swaps_down)
        self.swaps["up"].advance(stats.swaps_up)
        self.resizes["grow"].advance(stats.kv_grows)
        self.resizes["shrink"].advance(stats.kv_shrinks)
        self.swap_failures.advance(stats.swap_failures)
        self.restores_called_off.advance(stats.restores_called_off)
        self.invariant_violations.advance(stats.invariant_violations)
        self.prefix_lookups["hit"].advance(stats.prefix_cache_hit_blocks)
        self.prefix_lookups["miss"].advance(stats.prefix_cache_miss_blocks)
        self.prefix_reused_tokens.advance(stats.prefix_cache_reused_tokens)
        self.prefix_evictions.advance(stats.prefix_cache_evictions)
        self.prefix_evicted_misses.advance(stats.prefix_cache_evicted_miss_blocks)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        waiting = dict(stats.waiting_by_priority)
        for priority in set(waiting) | set(self._classes):  # a class seen once is reported, at 0 when none waits
            self._class(priority)[0].set(waiting.get(priority, 0))
        self.requests["active"].set(active)
        self.requests["waiting"].set(stats.waiting)
        self.requests["scheduled"].set(stats.running)
        self.kv_blocks["max"].set(stats.kv_blocks_total)
        self.kv_blocks["used"].set(stats.kv_blocks_used)
        self.kv_blocks["free"].set(stats.kv_blocks_free)
        self.kv_blocks["cached"].set(stats.kv_blocks_cached)
        self.kv_usage.set(stats.kv_usage)
        self.int4_layers.set(stats.int4_layers)
        self.lm_head_int8.set(stats.lm_head_int8)
        self.memory["budget"].set(stats.memory_budget_bytes)
        self.memory["used"].set(stats.memory_used_bytes)
        if stats.swaps_timed < self._swaps_seen:  # a new engine counts from zero again
            self._swaps_seen = 0
        for prepare_s, apply_s in stats.timings_since(self._swaps_seen):
            self.swap_prepare.observe(prepare_s)
            self.swap_apply.observe(apply_s)
        self._swaps_seen = stats.swaps_timed

    def request_finished(
        self, status: str, timings: RequestTimings | None = None, num_output_tokens: int = 0, priority: int = 0
    ) -> None:
        """Count a finished request; a request rejected before it reached the engine has no timings."""
        self.requests_total[status].increment(1)
        if timings is None:
            return
        _, class_ttft, class_queue = self._class(priority)
        if timings.scheduled is not None:
            self.queue_time.observe(max(0.0, timings.scheduled - timings.arrival))
            class_queue.observe(max(0.0, timings.scheduled - timings.arrival))
        if timings.first_token is not None:
            self.ttft.observe(max(0.0, timings.first_token - timings.arrival))
            class_ttft.observe(max(0.0, timings.first_token - timings.arrival))
            if timings.finished is not None and num_output_tokens > 1:
                self.tpot.observe(max(0.0, timings.finished - timings.first_token) / (num_output_tokens - 1))
        if timings.finished is not None:
            self.e2e.observe(max(0.0, timings.finished - timings.arrival))
