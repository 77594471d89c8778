"""Launcher: start a real tritonserver on a model repository.

    python -m trtllm_backend.serve [--model-repository DIR] [--http-port 8000 --grpc-port 8001
        --metrics-port 8002] [--param NAME=VALUE ...] [--backend-dir build/backends]

Uses /opt/tritonserver (the NGC image) when present, otherwise the tritonserver and Python backend shipped
in the installed nvidia-pytriton wheel (Triton 2.51). The work is done by trtllm_backend.triton (discovery,
config.pbtxt editing, the server lifecycle); this module is the command line.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .triton.params import ParamError, parse_assignment
# Re-exported: `from trtllm_backend import serve; serve.launch(...)` is the documented Python entry point.
from .triton.server import ServerHandle, free_ports, launch

__all__ = ["ServerHandle", "free_ports", "launch", "main"]


def _print_endpoints(handle: ServerHandle) -> None:
    m = handle.model
    print(f"""
[serve] ready: model '{m}'
  HTTP     http://localhost:{handle.http_port}   (/v2/models/{m}/generate, SSE: /v2/models/{m}/generate_stream)
  gRPC     localhost:{handle.grpc_port}
  metrics  {handle.metrics_url}
  try:
    curl -s -X POST localhost:{handle.http_port}/v2/models/{m}/generate \\
      -d '{{"text_input": "The capital of France is", "max_tokens": 16}}'
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_backend.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--model", default="smollm2", help="the model that --param applies to")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="override a config.pbtxt parameter for this run (repeatable); see the README")
    ap.add_argument("--backend-dir", default="build/backends")
    ap.add_argument("--no-build-fragments", action="store_true")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    ap.add_argument("--openai-port", type=int, default=None,
                    help="also start the OpenAI-compatible gateway (python -m trtllm_backend.openai) on this port")
    args = ap.parse_args(argv)
    # NOTE: installed before the server starts: a SIGTERM that arrives while it starts (a client saw it ready
    # before the launcher did, or the orchestrator gave up) stops it once started instead of killing the
    # launcher with the default action and leaving tritonserver to its death signal.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the server drains on SIGTERM; Ctrl-C means the same
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        overrides = dict(parse_assignment(a) for a in args.param)
        handle = launch(args.model_repository, model=args.model, http_port=args.http_port,
                        grpc_port=args.grpc_port, metrics_port=args.metrics_port, params=overrides,
                        backend_dir=args.backend_dir, build_fragments=not args.no_build_fragments,
                        ready_timeout=args.ready_timeout, extra_args=args.server_arg)
    except (ParamError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"[serve] error: {exc}", file=sys.stderr)
        return 2

    gateway = None
    if args.openai_port:
        from .openai.process import start_gateway

        fragments = Path(args.model_repository) / args.model / "1" / "fragments"
        try:
            gateway = start_gateway(f"localhost:{handle.grpc_port}", args.openai_port, host="0.0.0.0",
                                    extra_args=("--model", args.model, "--fragments", str(fragments)))
        except RuntimeError as exc:
            print(f"[serve] error: {exc}", file=sys.stderr)
            handle.stop()
            return 2
    _print_endpoints(handle)
    if gateway is not None:
        print(f"  OpenAI   http://localhost:{gateway.port}/v1   (chat/completions, completions, models)", flush=True)
    while handle.alive() and not stop.wait(0.5):
        pass
    if gateway is not None:
        gateway.stop()
    code = handle.stop()
    return 1 if handle.stub_died else code


if __name__ == "__main__":
    sys.exit(main())
