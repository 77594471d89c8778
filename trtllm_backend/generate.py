"""Stream a completion to the terminal: python -m trtllm_backend.generate "prompt" [options]."""

from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .engine import LLMEngine
from .errors import InvalidRequest
from .sampling import SamplingParams


def default_fragment_dir() -> str:
    from engines.build_fragments import default_fragment_dir as d

    return str(d())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--fragment-dir", default=None, help="default: model_repository/smollm2/1/fragments")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's ChatML template")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(fragment_dir=args.fragment_dir or default_fragment_dir()))
    prompt = engine.tokenizer.chat_prompt(args.prompt) if args.chat else args.prompt
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
            min_tokens=args.min_tokens,
        )
        t0 = time.monotonic()
        sys.stdout.write(args.prompt if not args.chat else "")
        last = None
        for out in engine.generate(prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            last = out
    except InvalidRequest as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = last.timings
    n = last.num_output_tokens
    ttft = t.first_token - t.arrival
    rate = (n - 1) / (t.finished - t.first_token) if n > 1 and t.finished > t.first_token else float("nan")
    print(
        f"\n[{n} tokens, finish={last.finish_reason}, TTFT {ttft * 1000:.0f} ms, decode {rate:.1f} tok/s, total {time.monotonic() - t0:.2f} s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
