"""Turns a request's new tokens into RequestOutput pieces: detokenize, stop checks, hold-back for stops."""

from __future__ import annotations

import logging
from typing import Callable

from .logprobs import TokenLogprob
from .outputs import KVReuse, RequestOutput
from .request import Request
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


class OutputStream:
    def __init__(self, req: Request, tokenizer: Tokenizer, on_output: Callable[[RequestOutput], None]):
        self.req = req
        self.tokenizer = tokenizer
        self.on_output = on_output
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids)
        self.text = ""  # output text so far (truncated at a stop string)
        self.sent = 0  # characters of self.text already emitted
        # Text that could be the start of a stop string is held back until it cannot be.
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1
        self.pending_ids: list[int] = []
        self.pending_int4: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False
        self.stop_reason: str | None = None
        self.kv_reuse: KVReuse | None = None  # set by the engine as the request finishes (its blocks still held)
        self.done = False

    def add_token(self, token: int, int4_layers: int, logprob: TokenLogprob | None = None) -> str | None:
        """Record one sampled token; emit what can be emitted. Returns a finish reason or None."""
        p, req = self.req.params, self.req
        self.pending_ids.append(token)
        self.pending_int4.append(int4_layers)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        reason = None
        if token in self.tokenizer.eos_token_ids and not p.ignore_eos and req.num_output > p.min_tokens:
            reason = "stop"  # the end-of-sequence token itself is not part of the text
        else:
            self.text += self.detok.add(token)
            if p.stop and req.num_output > p.min_tokens:
                start = max(0, self.sent - self.holdback - 1)
                hits = [i for i in (self.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    first = min(hits)
                    self.stop_reason = next(s for s in p.stop if self.text.find(s, start) == first)
                    self.text = self.text[:first]
                    reason = "stop"
        if reason is None and req.num_output >= p.max_tokens:
            reason = "length"
        if reason is None:
            self._emit(final=False)
        return reason

    def _emit(self, final: bool, reason: str | None = None, error: str | None = None) -> None:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        delta = self.text[self.sent : end]
        if not final and not delta and not self.pending_ids:
            return
        self.sent = end
        req, p = self.req, self.req.params
        prompt_logprobs = None
        if p.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            prompt_logprobs = [None, *req.prompt_logprobs]
        out = RequestOutput(
            request_id=self.req.request_id,
            text=delta,
            token_ids=self.pending_ids,
            int4_layers=self.pending_int4,
            finished=final,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(self.req.prompt_ids),
            num_output_tokens=self.req.num_output,
            timings=self.req.timings,
            preempted=self.req.preemptions,
            stop_reason=self.stop_reason if final else None,
            logprobs=self.pending_logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=list(req.prompt_ids) if prompt_logprobs is not None else None,
            cumulative_logprob=req.cumulative_logprob if p.logprobs is not None else None,
            kv_reuse=self.kv_reuse or req.kv_reuse(),
            priority=self.req.priority,
        )
        self.pending_ids, self.pending_int4, self.pending_logprobs = [], [], []
        try:
            self.on_output(out)
        except Exception:  # noqa: BLE001 - a broken client callback must not take the engine down
            log.exception("output callback of %s failed", self.req.request_id)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        if reason != "stop":  # a stop ends the text exactly where it matched
            self.text += self.detok.flush()
        self._emit(final=True, reason=reason, error=error)
