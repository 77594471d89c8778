"""The token budget of an iteration that carries decodes: prefill chunks cut so that the step stays within a
share of the TPOT SLO (Sarathi-Serve's stall-free batching).

A prefill chunk of `max_num_tokens` stalls every running stream for as long as the chunk takes: on one CPU core
a 256-token chunk is ~1.2 s, and a request with a handful of output tokens that meets two such steps misses a
0.35 s TPOT SLO however fast its other steps were (results/replay/capacity_tpot_default/notes.md). With
streams decoding, the scheduler gets instead the tokens that fit in `share x tpot_slo_s`; with none, the whole
`max_num_tokens` (nothing is stalled, and one large chunk is the fastest prefill).

A step's time is modelled as fixed + per_token x tokens: `fixed` (reading the weights once, the per-step calls)
from steps of decodes only, `per_token` from steps with a prefill chunk. Both are moving averages of what this
engine measured, so the budget follows the thread count, the layers' precision mix and the machine.
"""

from __future__ import annotations

MIN_PREFILL_CHUNK = 16  # tokens a step with decodes may always prefill: a waiting prompt always progresses
MIN_PREFILL_TO_MEASURE = 16  # prefill tokens a step needs before its time says something of a token's cost
SMOOTHING = 0.3  # weight of the newest step in the moving averages


class StepBudget:
    def __init__(self, max_num_tokens: int, target_s: float):
        """`target_s`: the time a step that carries decodes may take (0: no cut, every step gets max_num_tokens)."""
        if target_s < 0:
            raise ValueError(f"step time target must be >= 0 s (0: off), got {target_s!r}")
        self.max_num_tokens = max_num_tokens
        self.target_s = target_s
        self.fixed_s: float | None = None  # per step, whatever it computes
        self.per_token_s: float | None = None  # per token computed

    def tokens(self, decode_rows: int) -> int:
        """The step's token budget with `decode_rows` running requests in decode."""
        if not decode_rows or not self.target_s or self.per_token_s is None:
            return self.max_num_tokens
        fits = int((self.target_s - (self.fixed_s or 0.0)) / self.per_token_s)
        return min(self.max_num_tokens, max(decode_rows + MIN_PREFILL_CHUNK, fits))

    def observe(self, tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's measured time: `tokens` computed, `decode_rows` of them decodes."""
        if tokens <= 0 or seconds <= 0:
            return
        if tokens - decode_rows >= MIN_PREFILL_TO_MEASURE:
            per_token = max(seconds - (self.fixed_s or 0.0), 0.0) / tokens or seconds / tokens
            self.per_token_s = _blend(self.per_token_s, per_token)
        elif tokens == decode_rows:
            fixed = max(seconds - (self.per_token_s or 0.0) * tokens, 0.0)
            self.fixed_s = _blend(self.fixed_s, fixed)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
