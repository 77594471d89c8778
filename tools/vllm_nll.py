"""vLLM's per-token NLLs of given token ids (its prompt logprobs): run by tools.peer_perplexity in vLLM's own venv.

    build/peers/vllm-venv/bin/python tools/vllm_nll.py MODEL_DIR IDS_FILE [--dtype bfloat16] [--generate N]

IDS_FILE: one window a line, ids separated by spaces (tools.peer_perplexity.ids_text). Each window is a prompt of
its own (TokensPrompt: the ids as they are, no BOS added), prefix caching off, so each is scored from an empty
cache. Prints `dtype <what it ran>`, then llama-nll's format (`info ...`, then `nll <window> <nll of token 1> ...`: every position after the
first), which tools.peer_perplexity.parse_llama_nll reads. `--generate N` prints instead each window's N greedy
tokens (`gen <window> <id> ...`) from the window's first 32 ids, for the token-for-token check against the engine.
Imports only vLLM and the standard library: this venv has none of the project's packages.
"""

from __future__ import annotations

import argparse
import sys


def read_ids(path: str) -> list[list[int]]:
    with open(path) as f:
        return [[int(t) for t in line.split()] for line in f if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("ids")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--generate", type=int, default=0, help="greedy tokens per window instead of NLLs")
    ap.add_argument("--prefix", type=int, default=32, help="the prompt's length for --generate")
    # On the CPU backend this is the share of the machine's memory it reserves (weights + KV), checked free at start.
    ap.add_argument("--memory-utilization", type=float, default=0.1)
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    windows = read_ids(args.ids)
    longest = max(map(len, windows)) + max(args.generate, 1)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=longest,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.memory_utilization,
        seed=0,
    )
    config = llm.llm_engine.model_config
    print("dtype", str(config.dtype).removeprefix("torch."), flush=True)  # the dtype that "auto" resolved to
    if args.generate:
        params = SamplingParams(temperature=0.0, max_tokens=args.generate, min_tokens=args.generate, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=w[: args.prefix]) for w in windows]
        for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            print("gen", i, *out.outputs[0].token_ids)
        return 0
    # prompt_logprobs=0: only the prompt token's own logprob at each position (position 0 has none).
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    print(f"info windows {len(windows)} max_len {max(map(len, windows))}")
    for i, (w, out) in enumerate(zip(windows, outs)):
        nll = [-out.prompt_logprobs[j][t].logprob for j, t in enumerate(w) if j > 0]
        print("nll", i, *(f"{x:.9g}" for x in nll))
    return 0


if __name__ == "__main__":
    sys.exit(main())
