"""Launcher: start a real tritonserver on a model repository.

    python -m trtllm_backend.serve [--model-repository DIR] [--http-port 8000 --grpc-port 8001
        --metrics-port 8002] [--param NAME=VALUE ...] [--backend-dir build/backends]
        [--address ADDR] [--open-admin | --admin-key-file PATH --print-admin-key]

Uses /opt/tritonserver (the NGC image) when present, otherwise the tritonserver and Python backend shipped
in the installed nvidia-pytriton wheel (Triton 2.51). The work is done by trtllm_backend.triton (discovery,
config.pbtxt editing, the server lifecycle); this module is the command line.

Triton's admin APIs (shared memory, model repository, logging, trace) need the header `morphserve-admin-key`
(gRPC: `triton-grpc-protocol-morphserve-admin-key`) with the key of `$MORPHSERVE_ADMIN_KEY`, else a random key
written to a file only this user can read (its path is printed; the key is not). `--open-admin` (or
`MORPHSERVE_OPEN_ADMIN=1`) leaves them open. With `--openai-port` and a gateway key ($OPENAI_GATEWAY_API_KEY)
Triton listens on 127.0.0.1 only, unless --address says otherwise.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from . import env_vars
from .triton import admin
from .triton.params import ParamError, parse_assignment

# Re-exported: `from trtllm_backend import serve; serve.launch(...)` is the documented Python entry point.
from .triton.server import ServerHandle, free_ports, launch

__all__ = ["ServerHandle", "free_ports", "launch", "main"]


def _print_endpoints(handle: ServerHandle) -> None:
    m = handle.model
    print(
        f"""
[serve] ready: model '{m}'
  HTTP     http://{handle.http_url}   (/v2/models/{m}/generate, SSE: /v2/models/{m}/generate_stream)
  gRPC     {handle.grpc_url}
  metrics  {handle.metrics_url}
  try:
    curl -s -X POST {handle.http_url}/v2/models/{m}/generate \\
      -d '{{"text_input": "The capital of France is", "max_tokens": 16}}'
""",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_backend.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--model", default="smollm2", help="the model that --param applies to")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a config.pbtxt parameter for this run (repeatable); see docs/configuration.md",
    )
    ap.add_argument("--backend-dir", default="build/backends")
    ap.add_argument("--no-build-fragments", action="store_true")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    ap.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also start the OpenAI-compatible gateway (python -m trtllm_backend.openai) on this port",
    )
    ap.add_argument(
        "--address",
        default=env_vars.TRITON_ADDRESS.value() or None,
        help="Triton's HTTP and gRPC bind address (metrics follow HTTP) (default: "
        "$MORPHSERVE_TRITON_ADDRESS, else 127.0.0.1 when --openai-port fronts it with a key "
        "($OPENAI_GATEWAY_API_KEY), else every interface)",
    )
    ap.add_argument(
        "--open-admin",
        action="store_true",
        default=admin.open_from_env(),
        help="leave Triton's admin APIs (shared memory, model repository, logging, trace) open to "
        "anyone, as Triton does by itself (default: $MORPHSERVE_OPEN_ADMIN, else closed)",
    )
    ap.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help="where to write the admin key, mode 0600 (default: $MORPHSERVE_ADMIN_KEY_FILE, else "
        "admin-key.<http port> in $XDG_RUNTIME_DIR/morphserve or <tmp>/morphserve-<uid>; "
        "not written when $MORPHSERVE_ADMIN_KEY gives the key, unless named here)",
    )
    ap.add_argument("--print-admin-key", action="store_true", help="also print the admin key on stdout")
    args = ap.parse_args(argv)
    # NOTE: installed before the server starts: a SIGTERM that arrives while it starts (a client saw it ready
    # before the launcher did, or the orchestrator gave up) stops it once started instead of killing the
    # launcher with the default action and leaving tritonserver to its death signal.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the server drains on SIGTERM; Ctrl-C means the same
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    address = args.address
    if address is None and args.openai_port and env_vars.OPENAI_GATEWAY_API_KEY.value():
        address = "127.0.0.1"  # the keyed gateway is the way in: Triton itself only for this machine
    key_file = None
    try:
        overrides = dict(parse_assignment(a) for a in args.param)
        key, key_file = _admin_key(args)
        handle = launch(
            args.model_repository,
            model=args.model,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            params=overrides,
            backend_dir=args.backend_dir,
            build_fragments=not args.no_build_fragments,
            ready_timeout=args.ready_timeout,
            extra_args=args.server_arg,
            admin_key=key,
            open_admin=args.open_admin,
            address=address,
        )
    except (ParamError, FileNotFoundError, RuntimeError, TimeoutError, ValueError, OSError) as exc:
        print(f"[serve] error: {exc}", file=sys.stderr)
        _remove(key_file)
        return 2

    gateway = None
    if args.openai_port:
        from .openai.process import start_gateway

        fragments = Path(args.model_repository) / args.model / "1" / "fragments"
        try:
            gateway = start_gateway(
                handle.grpc_url,
                args.openai_port,
                host="0.0.0.0",
                extra_args=("--model", args.model, "--fragments", str(fragments)),
            )
        except RuntimeError as exc:
            print(f"[serve] error: {exc}", file=sys.stderr)
            handle.stop()
            return 2
    _print_endpoints(handle)
    if gateway is not None:
        print(f"  OpenAI   http://localhost:{gateway.port}/v1   (chat/completions, completions, models)", flush=True)
    _print_admin(handle, key_file, args.print_admin_key)
    while handle.alive() and not stop.wait(0.5):
        pass
    if gateway is not None:
        gateway.stop()
    code = handle.stop()
    _remove(key_file)
    return 1 if handle.stub_died else code


def _admin_key(args: argparse.Namespace) -> tuple[str | None, Path | None]:
    """(the admin key, the file it was written to): None, None with --open-admin; the operator's key
    ($MORPHSERVE_ADMIN_KEY) is written only to a file named with --admin-key-file."""
    if args.open_admin:
        return None, None
    given = admin.key_from_env()
    key = admin.check_key(given) if given else admin.new_key()
    if given and args.admin_key_file is None:
        return key, None
    path = args.admin_key_file or admin.default_key_file(args.http_port)
    return key, admin.write_key_file(path, key)


def _print_admin(handle: ServerHandle, key_file: Path | None, show_key: bool) -> None:
    if handle.admin_key is None:
        print(
            "  admin    OPEN: anyone who reaches Triton can use its shared-memory, model-repository, logging "
            "and trace APIs (--open-admin)",
            flush=True,
        )
        return
    where = f"key in {key_file} (mode 0600)" if key_file else f"key from ${admin.ADMIN_KEY_ENV}"
    print(
        f"  admin    shared memory, model repository, logging, trace: header '{admin.ADMIN_HEADER}' over HTTP, "
        f"'{admin.GRPC_ADMIN_HEADER}' over gRPC; {where}",
        flush=True,
    )
    if show_key:
        print(f"  admin key: {handle.admin_key}", flush=True)


def _remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
