"""A request as the scheduler and engine see it: tokens, computed tokens, block table, output state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from statistics import median

import torch

from .logprobs import TokenLogprob
from .outputs import KVReuse, RequestTimings
from .sampling import SamplingParams


# The tokens over which a stream's recent TPOT is taken: enough that one step carrying a prompt's prefill chunk
# does not read as a slow stream (a request's TPOT, as its SLO judges it, is a mean over all its tokens), few
# enough that a slowdown shows within a couple of seconds.
RECENT_TPOT_TOKENS = 16


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timings: RequestTimings
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    preemptions: int = 0
    generator: torch.Generator | None = None
    # Prefix cache (prefix_cache.py): names of the leading full blocks computed or reused, and the weights
    # version they were computed under (-1: none yet).
    block_names: list[bytes] = field(default_factory=list)
    cache_version: int = -1
    # KV reuse at the request's first admission (TensorRT-LLM's per-request kv_cache_reused_block and hit rate):
    # full prompt blocks found cached / looked up and computed, and the prompt tokens not prefilled for them.
    reused_blocks: int = 0
    missed_blocks: int = 0
    reused_tokens: int = 0
    # prompt_logprobs: entry i scores prompt token i + 1 (the first token has no context); filled as prefill
    # chunks run, kept across a preemption's recompute.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum over the generated tokens, when params.logprobs is set
    matcher: object | None = None  # the guide's grammar state (llguidance.LLMatcher), when params.guide is set
    token_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_TPOT_TOKENS + 1))  # last emits

    def note_token_time(self, now: float) -> None:
        self.token_times.append(now)

    @property
    def recent_tpot(self) -> float | None:
        """Mean time between this request's last RECENT_TPOT_TOKENS tokens, as its stream saw them (None before its
        second token)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def priority(self) -> int:
        """Lower is more important (vLLM's convention): admitted first, preempted last."""
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    def kv_reuse(self) -> KVReuse:
        """How much of the prompt's KV came from the cache at the request's first admission (prefix_cache.py)."""
        blocks = len(self.block_table)
        return KVReuse(
            reused_blocks=self.reused_blocks,
            missed_blocks=self.missed_blocks,
            new_blocks=max(0, blocks - self.reused_blocks),
            total_blocks=blocks,
            reused_tokens=self.reused_tokens,
        )


def streams_tpot(requests: list[Request]) -> float:
    """The median recent TPOT over these requests' streams (0.0 when none has two tokens yet): the decode-time
    pressure signal. Why not the step time: a step that also carries prefill chunks is slow, but the streams it
    delays by one gap are not slow (an exponential average of step times read 408-448 ms while the same
    requests' own TPOT was 0.11 s at P50, and layers were swapped for it; docs/capacity.md)."""
    recent = [t for r in requests if (t := r.recent_tpot) is not None]
    return median(recent) if recent else 0.0
