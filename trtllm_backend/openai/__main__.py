"""`python -m trtllm_backend.openai --triton localhost:8001 --port 9000`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn

from .. import env_vars
from .app import GatewayConfig, create_app
from .template import TemplateError

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trtllm_backend.openai", description=__doc__)
    p.add_argument("--triton", default="localhost:8001", help="Triton's gRPC address (default: %(default)s)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model", default="smollm2", help="the Triton model to forward to (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument(
        "--fragments",
        type=Path,
        default=ROOT / "model_repository" / "smollm2" / "1" / "fragments",
        help="fragment folder whose manifest carries the chat template (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=env_vars.OPENAI_GATEWAY_API_KEY.value() or None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $OPENAI_GATEWAY_API_KEY, else none)",
    )
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = GatewayConfig(
        triton_url=args.triton,
        triton_model=args.model,
        served_model=args.served_model_name or args.model,
        fragment_dir=args.fragments,
        api_key=args.api_key or None,
    )
    try:
        app = create_app(config)
    except TemplateError as exc:
        print(f"openai gateway: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
