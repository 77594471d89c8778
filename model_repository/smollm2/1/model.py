"""Triton Python-backend glue for the MorphServe engine (decoupled).

`execute` only decodes, validates and enqueues; the engine thread generates and queues its outputs; a
responder thread sends every response. Two more small threads: one polls `is_cancelled()` (client gone,
stream closed) and aborts, one refreshes the gauges from `engine.stats()`. `finalize` drains the engine and
joins them all; so does a drain the launcher asks for on SIGTERM (trtllm_backend/triton/shutdown.py says why).
"""

import itertools
import json
import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import triton_python_backend_utils as pb_utils

try:  # installed into the stub's environment: the venv's editable install, a .pth file in the Docker images
    import trtllm_backend  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"{exc}: the Python environment tritonserver runs this model in lacks the MorphServe "
        "project; install it there (pip install -e <project root>)"
    ) from exc

from trtllm_backend.errors import InvalidRequest, QueueFull
from trtllm_backend.outputs import RequestOutput
from trtllm_backend.triton import interface
from trtllm_backend.triton import params as triton_params
from trtllm_backend.triton import shutdown
from trtllm_backend.triton.metrics import TritonMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def decode_request(request, defaults: dict) -> interface.Decoded:
    """The request's tensors, under either TensorRT-LLM name set (trtllm_backend/triton/interface.py)."""
    arrays = {}
    for name in interface.BY_NAME:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return interface.decode_request(arrays, defaults)


def triton_error(exc: InvalidRequest):
    """Rename engine fields to the input names a client sent (prompt -> text_input, seed -> random_seed)."""
    name = interface.INPUT_OF_FIELD.get(exc.field, exc.field)
    message = str(exc)
    if message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2 :]
    return pb_utils.TritonError(f"{name}: {message}", pb_utils.TritonError.INVALID_ARG)


def make_response(piece: interface.Piece, returns: interface.Returns, token_count: int | None = None):
    outputs = interface.response_outputs(piece, returns, token_count)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in outputs.items()])


@dataclass(slots=True)
class LiveRequest:
    """One request between execute and its final response."""

    rid: str  # the engine's id (unique); triton_id may repeat or be empty
    triton_id: str
    sender: object
    stream: bool
    prefix: str  # the prompt, when echoed; sent with the first response
    returns: interface.Returns = field(default_factory=interface.Returns)
    echo: str = ""  # the echoed prompt, for LLM-API streaming (each response holds the whole text)
    total: interface.Piece = field(default_factory=interface.Piece)  # every output so far, joined
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
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="[morphserve] %(levelname)s %(name)s: %(message)s"
        )
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("smollm2 streams responses: set model_transaction_policy decoupled")
        raw = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = str(Path(args["model_repository"]) / args["model_version"])
        self.params = triton_params.parse_params(raw, base_dir=version_dir)  # ParamError names the parameter
        engine_config = triton_params.engine_config(self.params)
        self.engine = create_engine(engine_config)
        self.metrics = TritonMetrics(
            pb_utils,
            {"model": args["model_name"], "version": args["model_version"]},
            kv_capacity_blocks=engine_config.base_kv_blocks,
        )
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
        self.threads = [
            self.responder,
            threading.Thread(target=self._watch_cancellation, name="morph-cancel", daemon=True),
            threading.Thread(target=self._publish_metrics, name="morph-metrics", daemon=True),
        ]
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
                sender.send(make_response(interface.Piece(), interface.Returns()), flags=FINAL)
                return
            if self.closing:
                raise QueueFull("the model is shutting down")
            echo = "" if decoded.exclude_input else decoded.prompt
            live = LiveRequest(
                f"{triton_id or 'req'}#{next(self.ids)}", triton_id, sender, decoded.stream, echo, decoded.returns, echo
            )
            with self.lock:  # registered first: on_output may run before add_request returns
                self.live[live.rid] = live
            self.engine.add_request(
                decoded.prompt, decoded.params, lambda out, live=live: self.outbox.put((live, out)), request_id=live.rid
            )
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
                live.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[],
                        error=pb_utils.TritonError(f"engine error: {out.error}", pb_utils.TritonError.INTERNAL),
                    ),
                    final=True,
                )
            elif out.finish_reason == "abort" and self.closing and not live.cancelled:
                # cut off by the drain deadline: the client must learn its output is incomplete
                live.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[],
                        error=pb_utils.TritonError(
                            f"the server is shutting down: request aborted after drain_timeout_s="
                            f"{self.params.model.drain_timeout_s:g}",
                            pb_utils.TritonError.UNAVAILABLE,
                        ),
                    ),
                    final=True,
                )
            elif live.stream:
                live.total.add(out)
                piece = interface.Piece()
                piece.add(out)
                # NOTE: the LLM-API backend streams the whole text so far; the TensorRT-engine one the new text
                piece.text = (
                    live.echo + live.total.text if live.returns.cumulative_text else live.take_prefix() + out.text
                )
                if out.text or out.token_ids or (out.finished and out.finish_reason in ("stop", "length")):
                    # NOTE: an empty final piece is a response, not a bare flag: the client learns why it ended
                    live.send(make_response(piece, live.returns), final=out.finished)
                elif out.finished:
                    live.send(final=True)
            else:
                live.total.add(out)
                if out.finished:
                    live.total.text = live.take_prefix() + live.total.text
                    live.send(make_response(live.total, live.returns, out.num_output_tokens), final=True)
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
