"""Small dataclasses the engine hands to its callers (the Triton glue, the CLI, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .logprobs import TokenLogprob


@dataclass(slots=True)
class RequestTimings:
    arrival: float  # time.monotonic() when the request was added
    scheduled: float | None = None  # first time it entered the running batch
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True, frozen=True)
class KVReuse:
    """A request's KV blocks by origin (the LLM-API backend's kv_cache_* outputs)."""

    reused_blocks: int = 0  # prompt blocks found in the cache
    missed_blocks: int = 0  # prompt blocks computed
    new_blocks: int = 0  # blocks allocated for this request
    total_blocks: int = 0  # blocks it holds (reused + new)
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to the reused blocks

    @property
    def hit_rate(self) -> float:
        prompt = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / prompt if prompt else 0.0


@dataclass(slots=True)
class RequestOutput:
    """One streamed piece of a request: the tokens made since the previous output."""

    request_id: str
    text: str  # text delta (never half a UTF-8 character)
    token_ids: list[int]  # new token ids in this piece
    int4_layers: list[int]  # per new token: how many decoder layers ran quantized when it was made
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    timings: RequestTimings | None = None
    preempted: int = 0  # how many times this request was preempted and recomputed
    stop_reason: str | None = None  # on the final output: the stop string that ended it, if one did
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token, when params.logprobs is set
    # On the first output, when params.prompt_logprobs is set: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs
    cumulative_logprob: float | None = None  # over every generated token so far, when params.logprobs is set
    kv_reuse: KVReuse | None = None
    priority: int = 0


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by requests
    kv_blocks_free: int = 0  # free for requests: on the free lists, or cached and held by none (kv_blocks_cached)
    kv_blocks_cached: int = 0  # cached prefix blocks no request holds (evicted least recently used first)
    kv_usage: float = 0.0  # used / total
    # Automatic prefix caching (prefix_cache.py), counted at each admission: full prompt blocks found cached and
    # not found, prompt tokens not prefilled thanks to a hit, cached blocks evicted, and missed blocks the cache
    # had evicted (what a bigger pool would have served).
    prefix_cache_hit_blocks: int = 0
    prefix_cache_miss_blocks: int = 0
    prefix_cache_reused_tokens: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_evicted_miss_blocks: int = 0
    waiting_by_priority: tuple[tuple[int, int], ...] = ()  # (priority, waiting requests), most important first
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iterations: int = 0
    # Morph state (stays zero until the controller acts).
    int4_layers: int = 0
    lm_head_int8: int = 0  # 1 while the tied embedding / LM head runs from its INT8 fragment
    swaps_down: int = 0  # units swapped down (layers to INT4, the LM head to INT8) and up

    swaps_up: int = 0
    kv_grows: int = 0
    kv_shrinks: int = 0
    swap_failures: int = 0
    restores_called_off: int = 0  # restores called off because pressure returned mid-restore (morph.py)
    invariant_violations: int = 0  # broken invariants seen (trtllm_backend/invariants.py), one per line per iteration
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    # (prepare_s, apply_s) of the most recent swaps, oldest first (at most 256); the last one is swap number
    # `swaps_timed`, the count of every swap timed since start. Readers keep the count they saw: timings_since.
    swap_timings: tuple[tuple[float, float], ...] = ()
    swaps_timed: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        looked = self.prefix_cache_hit_blocks + self.prefix_cache_miss_blocks
        return self.prefix_cache_hit_blocks / looked if looked else 0.0

    def timings_since(self, seen: int) -> list[tuple[float, float]]:
        """The timings of swaps numbered after `seen` (a reader's previous `swaps_timed`) that this snapshot
        still holds; more than 256 swaps between two reads lose the oldest."""
        n = min(self.swaps_timed - seen, len(self.swap_timings))
        return list(self.swap_timings[len(self.swap_timings) - n :]) if n > 0 else []
