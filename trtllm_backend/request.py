"""A request as the scheduler and engine see it: tokens, computed tokens, block table, output state."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .outputs import RequestTimings
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
    # Prefix cache (prefix_cache.py): names of the leading full blocks computed or reused, and the weights
    # version they were computed under (-1: none yet).
    block_names: list[bytes] = field(default_factory=list)
    cache_version: int = -1
    # KV reuse at the request's first admission (TensorRT-LLM's per-request kv_cache_reused_block and hit rate):
    # full prompt blocks found cached / looked up and computed, and the prompt tokens not prefilled for them.
    reused_blocks: int = 0
    missed_blocks: int = 0
    reused_tokens: int = 0

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
    def kv_cache_hit_rate(self) -> float:
        looked = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / looked if looked else 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]
