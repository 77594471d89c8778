"""A request as the scheduler and engine see it: tokens, computed tokens, block table, output state."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .logprobs import TokenLogprob
from .outputs import KVReuse, RequestTimings
from .sampling import SamplingParams


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
    # prompt_logprobs: entry i scores prompt token i + 1 (the first token has no context); filled as prefill
    # chunks run, kept across a preemption's recompute.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum over the generated tokens, when params.logprobs is set
    matcher: object | None = None  # the guide's grammar state (llguidance.LLMatcher), when params.guide is set

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    def kv_reuse(self, block_size: int) -> KVReuse:
        """How much of the prompt's KV came from the cache. NOTE: the one place that says so: there is no prefix
        cache yet, so every prompt block is a miss and every block was newly allocated; the prefix-cache work
        fills `reused` here."""
        prompt_blocks = -(-len(self.prompt_ids) // block_size)
        blocks = len(self.block_table)
        return KVReuse(reused_blocks=0, missed_blocks=prompt_blocks, new_blocks=blocks, total_blocks=blocks)
