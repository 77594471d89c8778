"""The gateway's side of Triton: one gRPC bidirectional stream per request (tritonclient.grpc.aio).

Every request is sent with stream=true, so the gateway sees each piece as the engine makes it; a
non-streaming OpenAI answer is those pieces joined. Closing the call early (client gone) cancels the
stream, which Triton marks as cancelled and the model aborts (its KV blocks freed within an iteration).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from .errors import OpenAIError, bad_param

_ids = itertools.count()


@dataclass(slots=True)
class Generation:
    """What the gateway asks of the model (OpenAI names; None: the model's default)."""

    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_tokens: int | None = None
    priority: int | None = None
    logprobs: int | None = None  # None: none; k: each token's logprob and its k most likely alternatives
    prompt_logprobs: bool = False  # the prompt's tokens scored too (with the same k)
    guide: tuple[str, str] | None = None  # structured output: (guided_decoding_guide_type, guided_decoding_guide)


Alternatives = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(slots=True)
class Piece:
    text: str
    tokens: int  # generated tokens in this piece
    final: bool = False
    finish_reason: str | None = None  # on the final piece: "stop" or "length"
    prompt_tokens: int = 0  # the engine's count (on every piece)
    cached_tokens: int = 0  # of those, the ones the prefix cache held (on every piece)
    # With Generation.logprobs: this piece's tokens, their logprobs and alternatives.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[Alternatives] = field(default_factory=list)
    # With Generation.prompt_logprobs, on the first piece: the prompt's tokens (the first one's logprob None).
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[Alternatives] | None = None


# Triton input -> (the OpenAI field it came from, Triton datatype, numpy type)
_INPUTS = {
    "max_tokens": ("max_tokens", "INT32", np.int32),
    "temperature": ("temperature", "FP32", np.float32),
    "top_p": ("top_p", "FP32", np.float32),
    "random_seed": ("seed", "UINT64", np.uint64),
    "frequency_penalty": ("frequency_penalty", "FP32", np.float32),
    "presence_penalty": ("presence_penalty", "FP32", np.float32),
    "min_length": ("min_tokens", "INT32", np.int32),
    "priority": ("priority", "INT32", np.int32),
}
OPENAI_NAME = {name: field for name, (field, _, _) in _INPUTS.items()} | {
    "stop_words": "stop",
    "top_logprobs": "logprobs",
    "guided_decoding_guide": "response_format",
    "guided_decoding_guide_type": "response_format",
}


def _tensor(name: str, array: np.ndarray, datatype: str) -> InferInput:
    t = InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def build_inputs(gen: Generation) -> list[InferInput]:
    """Tensors as TensorRT-LLM clients send them (shape [1, 1]); unset fields are left to the model."""
    tensors = [
        _tensor("text_input", np.array([[gen.prompt.encode()]], dtype=np.object_), "BYTES"),
        _tensor("stream", np.array([[True]]), "BOOL"),
    ]
    for name, (attr, datatype, dtype) in _INPUTS.items():
        value = getattr(gen, attr)
        if value is not None:
            tensors.append(_tensor(name, np.array([[value]], dtype=dtype), datatype))
    if gen.stop:
        tensors.append(_tensor("stop_words", np.array([[s.encode() for s in gen.stop]], dtype=np.object_), "BYTES"))
    if gen.logprobs is not None:
        tensors.append(_tensor("top_logprobs", np.array([[gen.logprobs]], dtype=np.int32), "INT32"))
    if gen.prompt_logprobs:
        tensors.append(_tensor("return_prompt_log_probs", np.array([[True]]), "BOOL"))
    if gen.guide is not None:
        kind, guide = gen.guide
        tensors.append(_tensor("guided_decoding_guide_type", np.array([[kind.encode()]], dtype=np.object_), "BYTES"))
        if guide:
            tensors.append(_tensor("guided_decoding_guide", np.array([[guide.encode()]], dtype=np.object_), "BYTES"))
    return tensors


def triton_error(message: str, prompt_field: str, limit_field: str) -> OpenAIError:
    """A Triton error message -> OpenAI's shape. Triton 2.51 streams carry only the message, so the model's
    message conventions decide: "queue full: ..." (UNAVAILABLE) and "<input>: ..." (INVALID_ARG)."""
    if message.startswith("queue full"):
        return OpenAIError(503, f"the server is at capacity, retry later ({message})", code="queue_full")
    name, sep, detail = message.partition(": ")
    if sep:
        renamed = OPENAI_NAME | {"text_input": prompt_field, "max_tokens": limit_field}
        if name in renamed:
            return bad_param(renamed[name], detail)
    return OpenAIError(500, f"the model failed: {message}", code="model_error")


class TritonBackend:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_live() and await self.client.is_model_ready(self.model)
        except (InferenceServerException, grpc.RpcError):
            return False

    async def close(self) -> None:
        await self.client.close()

    async def generate(self, gen: Generation, prompt_field: str, limit_field: str) -> AsyncIterator[Piece]:
        """Pieces until the final one; an OpenAIError for a refused or failed request."""
        done = asyncio.Event()
        request = {
            "model_name": self.model,
            "inputs": build_inputs(gen),
            "request_id": f"oai-{next(_ids)}",
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def requests():
            yield request
            await done.wait()  # NOTE: keep our half of the stream open until the model's final response

        call = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise triton_error(error.message(), prompt_field, limit_field)
                piece = _piece(result)
                finished = piece.final
                yield piece
                if finished:
                    return
        except InferenceServerException as exc:  # the call itself failed (server unreachable)
            raise OpenAIError(
                503, f"Triton at {self.url} is unavailable: {exc.message()}", code="triton_unavailable"
            ) from None
        except grpc.RpcError as exc:
            raise OpenAIError(
                503, f"Triton at {self.url} is unavailable: {exc.details()}", code="triton_unavailable"
            ) from None
        finally:
            done.set()
            if not finished:  # the client went away (or we failed): cancel the request in Triton
                call.cancel()


def _piece(result) -> Piece:
    final = result.get_response().parameters["triton_final_response"].bool_param
    text = result.as_numpy("text_output")
    if text is None:  # the empty final response
        return Piece("", 0, final=True)
    reason = result.as_numpy("finish_reason")
    prompt, cached = result.as_numpy("prompt_token_count"), result.as_numpy("prompt_cached_token_count")
    piece = Piece(
        text=text.reshape(-1)[0].decode("utf-8"),
        tokens=int(result.as_numpy("output_token_count").reshape(-1)[0]),
        final=final,
        finish_reason=(reason.reshape(-1)[0].decode() or None) if reason is not None else None,
        prompt_tokens=int(prompt.reshape(-1)[0]) if prompt is not None else 0,
        cached_tokens=int(cached.reshape(-1)[0]) if cached is not None else 0,
    )
    if (ids := result.as_numpy("output_ids")) is not None:
        piece.token_ids = ids.reshape(-1).tolist()
        piece.logprobs = result.as_numpy("output_log_probs").reshape(-1).tolist()
        piece.top = _alternatives(result, "output_top_ids", "output_top_logprobs", len(piece.token_ids))
    if (ids := result.as_numpy("prompt_ids")) is not None:
        piece.prompt_ids = ids.reshape(-1).tolist()
        piece.prompt_logprobs = [
            None if np.isnan(v) else v for v in result.as_numpy("prompt_log_probs").reshape(-1).tolist()
        ]
        piece.prompt_top = _alternatives(result, "prompt_top_ids", "prompt_top_logprobs", len(piece.prompt_ids))
    return piece


def _alternatives(result, ids_name: str, values_name: str, n: int) -> list[Alternatives]:
    ids, values = result.as_numpy(ids_name), result.as_numpy(values_name)
    if ids is None:
        return [[] for _ in range(n)]
    ids, values = ids.reshape(n, -1).tolist(), values.reshape(n, -1).tolist()
    return [[(t, v) for t, v in zip(row_ids, row_values) if t >= 0] for row_ids, row_values in zip(ids, values)]
