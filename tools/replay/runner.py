"""The open-loop run of one planned window against a running server (gRPC streaming, or HTTP SSE).

Requests are sent when the trace says, whatever the server is doing (open loop), except a chat turn that follows
another (`Planned.follows`): it is sent when it is due or when the previous turn's answer has arrived, whichever
is later, carrying that answer in its prompt, as a chat user would (closed loop within a conversation; its due
time in the record is then when it was sent). Before the window starts it
measures the unloaded TTFT (a few requests one at a time) for the default SLO; while it runs it samples the
server's metrics for the timeline. At the end of the window it stops sending, waits up to `drain_s` for
requests in flight, and cancels the rest (counted as unfinished).
"""

from __future__ import annotations

import asyncio
import sys

from tqdm import tqdm

from tools.replay import metrics as rm
from collections.abc import Callable
from dataclasses import replace

from tools.replay.client import Clock, Planned, RequestRecord, chat_turn, make_target
from tools.replay.result import ReplayResult
from tools.replay.sampler import MetricsSampler


async def probe_ttft(target, prompt: Planned, n: int) -> list[float]:
    """TTFT of n requests sent one at a time (after one warm-up) to an idle server."""
    out = []
    for i in range(n + 1):
        rec = RequestRecord(-1 - i, 0.0, prompt.prompt_tokens, prompt.output_tokens)
        await target.send(prompt, rec, Clock())
        if rec.status != "ok":
            raise RuntimeError(f"unloaded probe request failed: {rec.status} {rec.error}")
        if i:
            out.append(rm.ttft(rec))
    return out


async def run_window(
    planned: list[Planned],
    target,
    metrics_url: str | None,
    window_s: float | None,
    drain_s: float,
    progress: bool,
    probe: Planned | None,
    probes: int,
    count_tokens: Callable[[str], int] | None = None,
) -> ReplayResult:
    """`count_tokens(text)`: the prompt tokens of a chat turn whose prompt is known only when it is sent (needed
    when any request follows another)."""
    if count_tokens is None and any(p.follows is not None for p in planned):
        raise ValueError("chat turns that follow others need count_tokens")
    unloaded = await probe_ttft(target, probe, probes) if probe is not None and probes else []
    clock = Clock()
    records = [
        RequestRecord(p.index, p.arrival_s, p.prompt_tokens, p.output_tokens, priority=p.priority) for p in planned
    ]
    stop = asyncio.Event()
    sampler = MetricsSampler(metrics_url, clock) if metrics_url else None
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    bar = progress_bar(len(planned), progress)
    tasks: list[asyncio.Task] = []
    lag = 0.0

    def finished(_task):
        bar.update(1)
        bar.set_postfix(
            in_flight=sum(not t.done() for t in tasks),
            failed=sum(r.status not in ("ok", "pending") for r in records),
            refresh=False,
        )

    by_index = {p.index: i for i, p in enumerate(planned)}
    followed = {p.follows for p in planned if p.follows is not None}
    answers: dict[int, list[str]] = {i: [] for i in followed}  # index -> the answer's text pieces
    sent: dict[int, str] = {}  # index -> the prompt sent, for the turn that follows it
    ended = {i: asyncio.Event() for i in followed}

    async def send(p: Planned, rec: RequestRecord) -> None:
        try:
            if p.follows is not None:
                await ended[p.follows].wait()
                if p.follows not in sent:  # its previous turn was cancelled before it was sent
                    rec.status, rec.error = "unfinished", f"turn {p.follows}, which it follows, was never sent"
                    return
                before = records[by_index[p.follows]]
                rec.arrival_s = max(p.arrival_s, before.end_s if before.end_s is not None else clock.now())
                await asyncio.sleep(max(0.0, rec.arrival_s - clock.now()))
                prompt = chat_turn(sent[p.follows], "".join(answers[p.follows]), p.prompt)
                rec.prompt_tokens = count_tokens(prompt)
                p = replace(p, prompt=prompt, prompt_tokens=rec.prompt_tokens, follows=None)
            sent[p.index] = p.prompt
            if p.index in answers:
                await target.send(p, rec, clock, answers[p.index])
            else:
                await target.send(p, rec, clock)
        finally:
            if p.index in ended:
                ended[p.index].set()  # a failed or cancelled turn still lets its conversation go on

    try:
        for p, rec in zip(planned, records):
            await asyncio.sleep(max(0.0, p.arrival_s - clock.now()))
            lag = max(lag, clock.now() - p.arrival_s)
            task = asyncio.create_task(send(p, rec))
            task.add_done_callback(finished)
            tasks.append(task)
        if window_s is not None:  # the window's idle tail is part of the run (the server may restore layers)
            await asyncio.sleep(max(0.0, window_s - clock.now()))
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=drain_s)
    finally:
        for t in tasks:
            t.cancel()  # clean stop: whatever is still running is cancelled on the server too
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        if sampling:
            await sampling
        bar.close()
    for rec in records:
        if rec.status == "pending":
            rec.status, rec.error = "unfinished", f"not done {drain_s:g} s after the window ended"
    return ReplayResult(records, sampler.samples if sampler else [], unloaded, lag, sampler.errors if sampler else 0)


def progress_bar(total: int, enabled: bool) -> tqdm:
    return tqdm(total=total, unit="req", desc="replay", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def replay(
    planned: list[Planned],
    protocol: str,
    url: str,
    metrics_url: str | None,
    window_s: float | None,
    drain_s: float = 60.0,
    progress: bool = True,
    probe: Planned | None = None,
    probes: int = 5,
    model: str = "smollm2",
    count_tokens: Callable[[str], int] | None = None,
) -> ReplayResult:
    """Replay the planned window against the server at `url` and return what happened (`count_tokens`: see
    run_window)."""

    async def go():
        target = make_target(protocol, url, model)
        try:
            return await run_window(
                planned, target, metrics_url, window_s, drain_s, progress, probe, probes, count_tokens
            )
        finally:
            await target.close()

    return asyncio.run(go())
