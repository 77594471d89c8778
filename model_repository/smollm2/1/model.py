"""Triton Python-backend glue for the MorphServe engine (decoupled).

`execute` only decodes, validates and enqueues; the engine thread generates and queues its outputs; a
responder thread sends every response. Two more small threads: one polls `is_cancelled()` (client gone,
stream closed) and aborts, one refreshes the gauges from `engine.stats()`. `finalize` drains the engine and
joins them all; so does a drain the launcher asks for on SIGTERM (trtllm_backend/triton/shutdown.py says why).
"""

import itertools
import json
import logging
import math
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:  # installed into the stub's environment: the venv's editable install, a .pth file in the Docker images
    import trtllm_backend  # noqa: F401
except ImportError as exc:
    raise ImportError(f"{exc}: the Python environment tritonserver runs this model in lacks the MorphServe "
                      "project; install it there (pip install -e <project root>)") from exc

from trtllm_backend.errors import InvalidRequest, QueueFull
from trtllm_backend.outputs import RequestOutput
from trtllm_backend.sampling import SamplingParams
from trtllm_backend.triton import params as triton_params
from trtllm_backend.triton import shutdown
from trtllm_backend.triton.metrics import TritonMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str  # the Triton input (TensorRT-LLM backend names)
    kind: str  # "text", "texts", "int", "float" or "bool"
    field: str | None = None  # the SamplingParams field it sets; None: read by the glue


INPUTS = (
    InputSpec("text_input", "text"),
    InputSpec("max_tokens", "int", "max_tokens"),
    InputSpec("temperature", "float", "temperature"),
    InputSpec("top_k", "int", "top_k"),
    InputSpec("top_p", "float", "top_p"),
    InputSpec("seed", "int", "seed"),  # the name Triton's OpenAI frontend may send; random_seed is TensorRT-LLM's
    InputSpec("random_seed", "int", "seed"),
    InputSpec("frequency_penalty", "float", "frequency_penalty"),
    InputSpec("presence_penalty", "float", "presence_penalty"),
    InputSpec("min_length", "int", "min_tokens"),
    InputSpec("priority", "int", "priority"),  # vLLM's request priority: lower is more important (scheduler.py)
    InputSpec("stop_words", "texts", "stop"),
    InputSpec("stream", "bool"),
    InputSpec("exclude_input_in_output", "bool"),
    InputSpec("beam_width", "int"),
    InputSpec("stop", "bool"),
)
# Engine/SamplingParams field -> the Triton input a client sent, so every error names what the client knows.
INPUT_OF_FIELD = {s.field: s.name for s in INPUTS if s.field} | {"prompt": "text_input", "text": "text_input"}


def _bad(spec: InputSpec, message: str) -> InvalidRequest:
    return InvalidRequest(spec.name, message)


def _utf8(spec: InputSpec, value) -> str:
    if not isinstance(value, bytes):
        raise _bad(spec, f"must be BYTES, got {type(value).__name__}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(spec, "is not valid UTF-8") from None


def decode_input(spec: InputSpec, array: np.ndarray):
    """One input tensor -> a Python value. Tolerant of shape ([1], [1, 1]) and of int/float widths;
    strict about meaning (an integer field rejects 2.5, a boolean rejects 7)."""
    if spec.kind == "texts":
        if array.dtype != np.object_:
            raise _bad(spec, f"must be BYTES, got {array.dtype}")
        return [w for w in (_utf8(spec, v) for v in array.reshape(-1)) if w]  # empty entries are padding
    if array.size != 1:
        raise _bad(spec, f"must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if spec.kind == "text":
        text = _utf8(spec, value)
        if not text:
            raise _bad(spec, "must not be empty")
        return text
    if spec.kind == "bool":
        if array.dtype == np.bool_ or (np.issubdtype(array.dtype, np.integer) and value in (0, 1)):
            return bool(value)
        raise _bad(spec, f"must be a boolean, got {value!r} ({array.dtype})")
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise _bad(spec, f"must be numeric, got {array.dtype}")
    number = value.item()
    if not math.isfinite(number):
        raise _bad(spec, f"must be finite, got {number!r}")
    if spec.kind == "int":
        if isinstance(number, float) and not number.is_integer():
            raise _bad(spec, f"must be an integer, got {number!r}")
        return int(number)
    return float(number)


@dataclass(slots=True)
class Decoded:
    prompt: str | None
    params: SamplingParams | None
    stream: bool
    exclude_input: bool
    stop: bool


def decode_request(request, defaults: dict) -> Decoded:
    values = {}
    for spec in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            values[spec.name] = decode_input(spec, tensor.as_numpy())
    stream = values.get("stream", False)
    if values.get("stop", False):  # a cancel request: nothing else matters
        return Decoded(None, None, stream, True, True)
    if "text_input" not in values:
        raise InvalidRequest("text_input", "is required")
    if values.get("beam_width", 1) != 1:
        raise InvalidRequest("beam_width", f"only 1 is supported, got {values['beam_width']}")
    if "seed" in values and "random_seed" in values and values["seed"] != values["random_seed"]:
        raise InvalidRequest("seed", "give seed or random_seed, not two different values")
    sampling = dict(defaults)
    sampling.update({s.field: values[s.name] for s in INPUTS if s.field and s.name in values})
    # NOTE: as in the TensorRT-LLM backend a streamed response carries only new text; a single response
    # echoes the prompt unless asked not to.
    exclude = values.get("exclude_input_in_output", stream)
    return Decoded(values["text_input"], SamplingParams(**sampling), stream, exclude, False)


def triton_error(exc: InvalidRequest):
    """Rename engine fields to the input names a client sent (prompt -> text_input, seed -> random_seed)."""
    name = INPUT_OF_FIELD.get(exc.field, exc.field)
    message = str(exc)
    if message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2:]
    return pb_utils.TritonError(f"{name}: {message}", pb_utils.TritonError.INVALID_ARG)


def make_response(text: str, token_count: int, int4_layers: list[int], prompt_tokens: int = 0,
                  finish_reason: str | None = None):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
        pb_utils.Tensor("output_token_count", np.array([[token_count]], dtype=np.int32)),
        pb_utils.Tensor("int4_layers", np.array([int4_layers], dtype=np.int32).reshape(1, -1)),
        pb_utils.Tensor("prompt_token_count", np.array([[prompt_tokens]], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([[(finish_reason or "").encode()]], dtype=np.object_)),
    ])


@dataclass(slots=True)
class LiveRequest:
    """One request between execute and its final response."""

    rid: str  # the engine's id (unique); triton_id may repeat or be empty
    triton_id: str
    sender: object
    stream: bool
    prefix: str  # the prompt, when echoed; sent with the first response
    parts: list[str] = field(default_factory=list)  # non-streaming: text so far
    int4: list[int] = field(default_factory=list)
    cancelled: bool = False
    closed: bool = False  # the final response was sent
    # NOTE: is_cancelled() after the final response dereferences a freed response factory in Triton 2.51
    # (the server segfaults), so a poll and the final send never overlap.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_prefix(self) -> str:
        prefix, self.prefix = self.prefix, ""
        return prefix

    def send(self, response=None, final: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = final
            if response is None:
                self.sender.send(flags=FINAL)
            else:
                self.sender.send(response, flags=FINAL if final else 0)

    def poll_cancelled(self) -> bool:
        """True once, when the client went away."""
        with self.lock:
            if self.closed or self.cancelled or not self.sender.is_cancelled():
                return False
            self.cancelled = True
            return True


class TritonPythonModel:
    def initialize(self, args):
        # The engine logs each morph action with its reason; send those lines to the server's log.
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[morphserve] %(levelname)s %(name)s: %(message)s")
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("smollm2 streams responses: set model_transaction_policy decoupled")
        raw = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = str(Path(args["model_repository"]) / args["model_version"])
        self.params = triton_params.parse_params(raw, base_dir=version_dir)  # ParamError names the parameter
        engine_config = triton_params.engine_config(self.params)
        self.engine = create_engine(engine_config)
        self.metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]},
                                     kv_capacity_blocks=engine_config.base_kv_blocks)
        self.live: dict[str, LiveRequest] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.closing = False
        self.stopping = threading.Event()
        self.outbox: queue.Queue = queue.Queue()  # (LiveRequest, RequestOutput) from the engine thread; None ends
        self.control = shutdown.control_dir()
        self.drain_lock = threading.Lock()
        self.drained = False
        self.engine.start()
        self.responder = threading.Thread(target=self._respond, name="morph-respond", daemon=True)
        self.threads = [self.responder,
                        threading.Thread(target=self._watch_cancellation, name="morph-cancel", daemon=True),
                        threading.Thread(target=self._publish_metrics, name="morph-metrics", daemon=True)]
        for t in self.threads:
            t.start()

    # --- requests ---------------------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            self._enqueue(request)
        return None  # decoupled: every response leaves from the responder thread

    def _enqueue(self, request) -> None:
        sender = request.get_response_sender()
        triton_id = request.request_id()
        live = None
        try:
            decoded = decode_request(request, self.params.sampling)
            if decoded.stop:
                self._stop_by_triton_id(triton_id)
                sender.send(make_response("", 0, []), flags=FINAL)
                return
            if self.closing:
                raise QueueFull("the model is shutting down")
            live = LiveRequest(f"{triton_id or 'req'}#{next(self.ids)}", triton_id, sender, decoded.stream,
                               "" if decoded.exclude_input else decoded.prompt)
            with self.lock:  # registered first: on_output may run before add_request returns
                self.live[live.rid] = live
            self.engine.add_request(decoded.prompt, decoded.params, lambda out, live=live: self.outbox.put((live, out)),
                                    request_id=live.rid)
        except InvalidRequest as exc:
            self._reject(sender, live, triton_error(exc))
        except QueueFull as exc:
            self._reject(sender, live, pb_utils.TritonError(f"queue full: {exc}", pb_utils.TritonError.UNAVAILABLE))
        except Exception as exc:  # never let one request take the stub down
            log_error(f"request {triton_id!r} failed: {exc!r}")
            self._reject(sender, live, pb_utils.TritonError(f"internal error: {exc}", pb_utils.TritonError.INTERNAL))

    def _reject(self, sender, live: LiveRequest | None, error) -> None:
        self.metrics.request_finished("error")
        response = pb_utils.InferenceResponse(output_tensors=[], error=error)
        if live is None:
            sender.send(response, flags=FINAL)
            return
        with self.lock:
            self.live.pop(live.rid, None)
        live.send(response, final=True)

    def _stop_by_triton_id(self, triton_id: str) -> None:
        with self.lock:
            targets = [lv for lv in self.live.values() if triton_id and lv.triton_id == triton_id]
        for live in targets:
            live.cancelled = True  # asked for: its end is no shutdown error
            self.engine.abort(live.rid)

    def _respond(self) -> None:
        """Every response leaves from here. NOTE: a send is an IPC round trip to tritonserver (0.2-0.6 ms
        here), so the engine thread only queues its outputs and never waits on one."""
        while True:
            item = self.outbox.get()
            try:
                if item is None:
                    return
                self._send_output(*item)
            finally:
                self.outbox.task_done()

    def _send_output(self, live: LiveRequest, out: RequestOutput) -> None:
        try:
            if out.finish_reason == "error":
                live.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"engine error: {out.error}", pb_utils.TritonError.INTERNAL)), final=True)
            elif out.finish_reason == "abort" and self.closing and not live.cancelled:
                # cut off by the drain deadline: the client must learn its output is incomplete
                live.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"the server is shutting down: request aborted after drain_timeout_s="
                    f"{self.params.model.drain_timeout_s:g}", pb_utils.TritonError.UNAVAILABLE)), final=True)
            elif live.stream:
                text = live.take_prefix() + out.text
                if text or out.token_ids:
                    live.send(make_response(text, len(out.token_ids), out.int4_layers, out.num_prompt_tokens,
                                            out.finish_reason), final=out.finished)
                elif out.finished and out.finish_reason in ("stop", "length"):
                    # NOTE: a response, not a bare final flag: the client learns why it ended (OpenAI's finish_reason)
                    live.send(make_response("", 0, [], out.num_prompt_tokens, out.finish_reason), final=True)
                elif out.finished:
                    live.send(final=True)
            else:
                live.parts.append(out.text)
                live.int4.extend(out.int4_layers)
                if out.finished:
                    text = live.take_prefix() + "".join(live.parts)
                    live.send(make_response(text, out.num_output_tokens, live.int4, out.num_prompt_tokens,
                                            out.finish_reason), final=True)
        except Exception as exc:  # the client may be gone; the request still has to be accounted
            log_error(f"sending a response for {live.rid} failed: {exc!r}")
        if out.finished:
            with self.lock:
                self.live.pop(live.rid, None)
            status = {"error": "error", "abort": "cancelled"}.get(out.finish_reason, "success")
            if out.finish_reason == "abort" and self.closing and not live.cancelled:
                status = "error"
            self.metrics.request_finished(status, out.timings, out.num_output_tokens, out.priority)

    # --- background threads -----------------------------------------------------------------------------------
    def _watch_cancellation(self) -> None:
        parent = os.getppid()
        while not self.stopping.wait(self.params.model.cancel_poll_interval_s):
            if os.getppid() != parent:  # tritonserver died (killed, crashed): an orphaned stub holds the model
                log_error("tritonserver is gone: exiting the stub")
                os._exit(1)
            if self.control is not None and not self.closing and shutdown.drain_requested(self.control):
                threading.Thread(target=self._drain, name="morph-drain", daemon=True).start()
            with self.lock:
                candidates = [lv for lv in self.live.values() if not lv.cancelled]
            for live in candidates:
                try:
                    if live.poll_cancelled():
                        self.engine.abort(live.rid)
                except Exception as exc:
                    log_error(f"cancellation check for {live.rid} failed: {exc!r}")

    def _publish_metrics(self) -> None:
        while not self.stopping.wait(self.params.model.metrics_interval_s):
            try:
                with self.lock:
                    active = len(self.live)
                self.metrics.update(self.engine.stats(), active)
            except Exception as exc:
                log_error(f"metrics update failed: {exc!r}")

    def _drain(self) -> None:
        """Once: refuse new requests, let running ones finish for drain_timeout_s, abort the rest (each gets
        an error), and wait until every response has left."""
        with self.drain_lock:
            if self.drained:
                return
            self.closing = True
            self.engine.shutdown(drain_timeout_s=self.params.model.drain_timeout_s)  # final outputs are queued
            self.outbox.join()
            self.drained = True
            if self.control is not None:
                shutdown.mark(self.control, "drained")

    def finalize(self):
        if self.control is not None:
            shutdown.mark(self.control, "finalizing")
        self._drain()
        self.outbox.put(None)  # the responder ends
        self.stopping.set()
        for t in self.threads:
            t.join()


def create_engine(config):
    """Separate so the unit tests can hand in a fake engine."""
    from trtllm_backend.engine import LLMEngine

    return LLMEngine(config)


def log_error(message: str) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_error(message)
    else:
        print(message, file=sys.stderr, flush=True)
