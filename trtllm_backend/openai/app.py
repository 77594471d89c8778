"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics (and a clear refusal
of /v1/responses)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import OpenAIError, unknown_model
from .logprobs import Scored, chat_logprobs, completion_logprobs
from .metrics import GatewayMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse
from .template import ChatTemplate
from .tokens import TokenTexts
from .triton_client import Generation, Piece, TritonBackend

CLIENT_GONE = 499  # nginx's code for "client closed the request", for the gateway's own counter only
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks whether its client is still there


@dataclass(slots=True)
class GatewayConfig:
    triton_url: str = "localhost:8001"
    triton_model: str = "smollm2"  # the model's name in Triton
    served_model: str = "smollm2"  # the name OpenAI clients use
    fragment_dir: Path = Path("model_repository/smollm2/1/fragments")  # where the chat template ships
    api_key: str | None = None


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else _dumps(obj)}\n\n"


@dataclass(slots=True)
class _Call:
    """One OpenAI request on its way through the gateway: the shape of its answer and its tallies."""

    kind: str  # "chat" or "completion"
    model: str
    id: str
    created: int
    arrival: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    texts: TokenTexts | None = None  # set when the request asked for logprobs
    echo: str = ""  # completions' echo: the prompt, sent before the output
    scored: Scored = field(default_factory=Scored)  # every scored token so far (a whole answer's logprobs)
    offset: int = 0  # completions' text_offset of the next token

    def add(self, piece: Piece) -> None:
        self.completion_tokens += piece.tokens
        self.prompt_tokens = piece.prompt_tokens or self.prompt_tokens
        self.cached_tokens = piece.cached_tokens or self.cached_tokens
        if piece.final:
            self.finish_reason = piece.finish_reason
        if self.texts is not None:
            self.scored.add(piece, with_prompt=bool(self.echo))

    def logprobs(self, piece: Piece | None = None) -> dict | None:
        """The logprobs of one piece (a streamed chunk) or, without one, of everything so far (a whole answer)."""
        if self.texts is None:
            return None
        if piece is not None:
            scored = Scored()
            scored.add(piece, with_prompt=bool(self.echo))
        else:
            scored, self.offset = self.scored, 0
        if self.kind == "chat":
            return chat_logprobs(self.texts, scored)
        obj, self.offset = completion_logprobs(self.texts, scored, self.offset)
        return obj

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        first: bool = False,
        usage: bool = False,
        piece: Piece | None = None,
    ) -> dict:
        logprobs = self.logprobs(piece) if piece is not None else None
        if self.kind == "chat":
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if usage:  # with include_usage every chunk carries "usage": null, the last one the totals
            out["usage"] = None
        return out

    def whole(self, text: str) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(),
                "finish_reason": self.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": self.echo + text,
                "logprobs": self.logprobs(),
                "finish_reason": self.finish_reason,
            }
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }


def create_app(config: GatewayConfig, template: ChatTemplate | None = None, texts: TokenTexts | None = None) -> FastAPI:
    template = template or ChatTemplate.from_fragments(config.fragment_dir)
    texts = texts or TokenTexts.from_fragments(config.fragment_dir)
    metrics = GatewayMetrics()
    started = int(time.time())
    state: dict[str, TritonBackend] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["backend"] = TritonBackend(config.triton_url, config.triton_model)  # bound to the server's loop
        yield
        await state["backend"].close()

    app = FastAPI(title="MorphServe OpenAI gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return OpenAIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code="not_found" if exc.status_code == 404 else None,
        ).response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise OpenAIError(
                401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key"
            )

    def check_model(name: str) -> None:
        if name != config.served_model:
            raise unknown_model(name, config.served_model)

    def model_card() -> dict:
        return {"id": config.served_model, "object": "model", "created": started, "owned_by": "morphserve"}

    @app.get("/health")
    async def health():
        if await state["backend"].ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "triton": config.triton_url}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str, request: Request):
        authorize(request)
        check_model(name)
        return model_card()

    @app.post("/v1/responses")
    async def responses(request: Request):
        authorize(request)
        # NOTE: a clear refusal, not a bare 404: SDKs and agent frameworks try this endpoint first. 404 (not 501),
        # so the official client does not retry it.
        raise OpenAIError(
            404,
            "POST /v1/responses: the Responses API is not served by this gateway; use "
            "POST /v1/chat/completions (or /v1/completions)",
            code="unsupported_endpoint",
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse(CompletionRequest, await _json(request))
        check_model(req.model)
        return await serve(request, "completion", req, req.text, "prompt", echo=req.echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse(ChatCompletionRequest, await _json(request))
        check_model(req.model)
        messages = [m.for_template() for m in req.messages]
        return await serve(request, "chat", req, template.render(messages), "messages")

    async def serve(
        request: Request, kind: str, req: GenerationRequest, prompt: str, prompt_field: str, echo: bool = False
    ):
        arrival = time.monotonic()
        limit_field, limit = req.output_limit
        gen = Generation(
            prompt,
            max_tokens=limit,
            temperature=req.temperature,
            top_p=req.top_p,
            stop=tuple(req.stop_list),
            seed=req.seed,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            min_tokens=req.min_output,
            logprobs=req.alternatives,
            prompt_logprobs=echo and req.alternatives is not None,
            guide=req.guide,
            priority=req.priority,
        )
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        call = _Call(
            kind,
            req.model,
            f"{prefix}-{uuid.uuid4().hex}",
            int(time.time()),
            arrival,
            texts=texts if req.alternatives is not None else None,
            echo=prompt if echo else "",
        )
        pieces = state["backend"].generate(gen, prompt_field, limit_field)
        endpoint = request.url.path
        metrics.in_flight.inc()
        try:
            # The first piece is awaited here, so a refused request (bad value, queue full) gets its status.
            first = await anext(pieces)
        except BaseException:
            metrics.in_flight.dec()
            raise
        if req.stream:
            return StreamingResponse(
                stream(call, first, pieces, req.include_usage, endpoint),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            return await whole(request, call, first, pieces, endpoint)
        finally:
            metrics.in_flight.dec()

    async def whole(request: Request, call: _Call, first: Piece, pieces: AsyncIterator[Piece], endpoint: str):
        parts = [first.text]
        call.add(first)

        async def rest():
            async for piece in pieces:
                parts.append(piece.text)
                call.add(piece)

        task = asyncio.ensure_future(rest()) if not first.final else None
        while task is not None and not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # unwinds generate(): its Triton call is cancelled
                metrics.cancelled.inc()
                metrics.finished(endpoint, CLIENT_GONE, time.monotonic() - call.arrival)
                return Response(status_code=CLIENT_GONE)
        if task is not None:
            task.result()  # an OpenAIError raised mid-way goes to its handler
        if call.completion_tokens:
            metrics.ttft.labels(endpoint).observe(time.monotonic() - call.arrival)  # no earlier byte was sent
        metrics.finished(endpoint, 200, time.monotonic() - call.arrival)
        return call.whole("".join(parts))

    async def stream(call: _Call, first: Piece, pieces: AsyncIterator[Piece], include_usage: bool, endpoint: str):
        status = CLIENT_GONE
        try:
            if call.kind == "chat":
                yield _sse(call.chunk(None, None, first=True, usage=include_usage))
            sent_text = False
            piece = first
            echo = call.echo  # sent with the first chunk
            while True:
                call.add(piece)
                if piece.text or piece.final or piece.token_ids or echo:
                    if piece.text and not sent_text:
                        sent_text = True
                        metrics.ttft.labels(endpoint).observe(time.monotonic() - call.arrival)
                    yield _sse(
                        call.chunk(
                            echo + piece.text,
                            call.finish_reason if piece.final else None,
                            usage=include_usage,
                            piece=piece,
                        )
                    )
                    echo = ""
                if piece.final:
                    break
                piece = await anext(pieces)
            if include_usage:
                yield _sse({**call.chunk(None, None), "choices": [], "usage": call.usage()})
            status = 200
        except OpenAIError as exc:  # after the 200 went out: the error travels as an event, as vLLM does
            status = exc.status
            yield _sse(exc.body())
        finally:
            if status == CLIENT_GONE:
                metrics.cancelled.inc()
            await pieces.aclose()  # cancels the Triton request unless it finished
            metrics.in_flight.dec()
            metrics.finished(endpoint, status, time.monotonic() - call.arrival)
        yield _sse("[DONE]")

    return app


async def _json(request: Request) -> object:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"body: not valid JSON ({exc})", param="body", code="invalid_json") from None
