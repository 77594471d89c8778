"""One streamed generation request, timed on the client: over Triton gRPC streaming or HTTP SSE.

Each request records when it was due, sent, got its first token and every later token, and ended, with its
status and the INT4-layer count the server reports for every token. Times are seconds on the run's own
clock (`time.perf_counter() - t0`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

MODEL = "smollm2"


@dataclass(slots=True)
class Planned:
    index: int
    arrival_s: float
    prompt: str
    prompt_tokens: int
    output_tokens: int  # forced: max_tokens = min_length = this
    priority: int = 0  # the model's `priority` input (lower is more important); 0 is not sent
    # A chat client's next turn: the index of its conversation's previous turn. It is sent only after that turn
    # ended, and its prompt is then `chat_turn(previous prompt, the server's answer, prompt)`; `prompt_tokens`
    # is the plan's estimate until it is sent.
    follows: int | None = None


def chat_turn(history: str, answer: str, message: str) -> str:
    """A multi-turn prompt: the previous turn's prompt with its answer right after it, as the server generated it
    (so the blocks holding the answer's tokens can be found again), then the new message on a line of its own;
    the open-loop plan and the closed-loop client join turns alike."""
    return history + answer + "\n" + message


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival_s: float  # when it was due (open loop)
    prompt_tokens: int
    max_tokens: int
    send_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    token_s: list[float] = field(default_factory=list)  # one entry per generated token
    chunk_s: list[float] = field(default_factory=list)  # one entry per response that carried tokens
    int4_layers: list[int] = field(default_factory=list)  # one entry per generated token
    status: str = "pending"  # ok | error | rejected | unfinished
    error: str = ""
    priority: int = 0  # as sent (Planned.priority): reports split attainment by class

    @property
    def output_tokens(self) -> int:
        return len(self.token_s)


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


def _record_tokens(rec: RequestRecord, now: float, count: int, int4: list[int]) -> None:
    if count <= 0:
        return
    if rec.first_token_s is None:
        rec.first_token_s = now
    rec.token_s.extend([now] * count)
    rec.chunk_s.append(now)
    # NOTE: int4_layers has one entry per token; pad defensively so the two lists stay aligned.
    rec.int4_layers.extend((list(int4) + [int4[-1] if int4 else 0] * count)[:count])


def _classify(message: str) -> str:
    return "rejected" if "queue full" in message or "UNAVAILABLE" in message else "error"


class GrpcTarget:
    """Triton gRPC streaming; one bidirectional stream per request, spread over a few channels so more than
    one HTTP/2 connection's worth of streams can be in flight."""

    def __init__(self, url: str, model: str = MODEL, channels: int = 4):
        import tritonclient.grpc.aio as grpcclient

        self._grpc = grpcclient
        # NOTE: a local subchannel pool per client gives each its own connection (a shared one would cap us
        # at the server's concurrent-stream limit).
        self.clients = [
            grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(channels)
        ]
        self.model = model
        self._next = 0

    def _inputs(self, p: Planned) -> list:
        g = self._grpc

        def tensor(name, value, dtype):
            t = g.InferInput(name, [1, 1], dtype)
            t.set_data_from_numpy(np.array([[value]], dtype=object if dtype == "BYTES" else None))
            return t

        inputs = [
            tensor("text_input", p.prompt.encode(), "BYTES"),
            tensor("max_tokens", np.int32(p.output_tokens), "INT32"),
            tensor("min_length", np.int32(p.output_tokens), "INT32"),
            tensor("stream", True, "BOOL"),
            tensor("exclude_input_in_output", True, "BOOL"),
        ]
        if p.priority:
            inputs.append(tensor("priority", np.int32(p.priority), "INT32"))
        return inputs

    async def send(self, p: Planned, rec: RequestRecord, clock: Clock, text: list[str] | None = None) -> None:
        """Stream `p`, timing it into `rec`; the answer's text pieces are appended to `text` when given."""
        client = self.clients[self._next % len(self.clients)]
        self._next += 1
        done = asyncio.Event()

        async def requests():
            yield {
                "model_name": self.model,
                "inputs": self._inputs(p),
                "request_id": str(p.index),
                "parameters": {"triton_enable_empty_final_response": True},
            }
            await done.wait()  # keep our side open until the final response

        rec.send_s = clock.now()
        stream = client.stream_infer(requests())
        try:
            async for result, error in stream:
                now = clock.now()
                if error is not None:
                    rec.status, rec.error = _classify(str(error)), str(error)
                    break
                count = int(result.as_numpy("output_token_count").reshape(-1)[0])
                int4 = result.as_numpy("int4_layers")
                _record_tokens(rec, now, count, [] if int4 is None else int4.reshape(-1).tolist())
                if text is not None and count > 0:
                    text.append(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace"))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    rec.status = "ok"
                    break
        except asyncio.CancelledError:
            stream.cancel()  # the server aborts the request and frees its KV blocks
            raise
        finally:
            rec.end_s = clock.now()
            done.set()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


class HttpSseTarget:
    """Triton's HTTP `generate_stream` (server-sent events), as the vLLM benchmark's tensorrt-llm client."""

    def __init__(self, url: str, model: str = MODEL):
        import aiohttp

        self._aiohttp = aiohttp
        self.url = f"http://{url}/v2/models/{model}/generate_stream"
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )

    async def send(self, p: Planned, rec: RequestRecord, clock: Clock, text: list[str] | None = None) -> None:
        """Stream `p`, timing it into `rec`; the answer's text pieces are appended to `text` when given."""
        body = {
            "text_input": p.prompt,
            "max_tokens": p.output_tokens,
            "min_length": p.output_tokens,
            "stream": True,
            "exclude_input_in_output": True,
        } | ({"priority": p.priority} if p.priority else {})
        rec.send_s = clock.now()
        try:
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    rec.status, rec.error = _classify(text), f"HTTP {resp.status}: {text[:200]}"
                    return
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = json.loads(line[5:])
                    if "error" in data:
                        rec.status, rec.error = _classify(data["error"]), data["error"]
                        return
                    int4 = data.get("int4_layers", [])
                    _record_tokens(
                        rec,
                        clock.now(),
                        int(data.get("output_token_count", 0)),
                        int4 if isinstance(int4, list) else [int4],
                    )
                    if text is not None and data.get("text_output"):
                        text.append(data["text_output"])
                rec.status = "ok"
        finally:
            rec.end_s = clock.now()

    async def close(self) -> None:
        await self.session.close()


def make_target(protocol: str, url: str, model: str = MODEL):
    if protocol == "grpc":
        return GrpcTarget(url, model)
    if protocol == "http":
        return HttpSseTarget(url, model)
    raise ValueError(f"unknown protocol {protocol!r} (grpc, http)")
