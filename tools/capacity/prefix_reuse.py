"""How much prefill prefix caching saves on multi-turn traffic, without the model: the turns' prompts go through
the engine's own scheduler and KV pool (prefix cache on, then off), each turn prefilled, given its output tokens
and finished before the next arrives; prints prompt tokens against tokens prefilled, for two kinds of client:

- open: the prompts tools.capacity.conversations plans for an open-loop replay (text, tokenized as served): a
  turn carries a corpus stand-in for the previous answer, which the server never generated, so only the previous
  prompt can be reused;
- chat: a chat client that resends the server's own answer tokens (the stand-in answer is what the server
  generated here), so the whole conversation before the new message can be reused.

NOTE: sequential, so it never holds two requests at once: it measures what LRU keeps at that pool size, not
contention. Capacity itself is measured by tools.capacity with a server.

    python -m tools.capacity.prefix_reuse --kind conv-kv --rate-scale 0.1 --pool-tokens 8192
"""

from __future__ import annotations

import argparse
import itertools

import torch

from tools.capacity.conversations import Conversations, plan_turns
from tools.capacity.traffic import KINDS
from tools.replay.prompts import PromptSource, load_tokenizer
from trtllm_backend.kv_cache import KVPool
from trtllm_backend.manifest import ModelConfig
from trtllm_backend.outputs import RequestTimings
from trtllm_backend.request import Request
from trtllm_backend.sampling import SamplingParams
from trtllm_backend.scheduler import Scheduler

# The pool's bookkeeping is what is measured: one tiny layer of K/V keeps its tensors small.
_TINY = ModelConfig(
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=1,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=0,
)


def prefilled(
    prompts: list[list[int]], outputs: list[list[int] | int], pool_tokens: int, block_size: int, caching: bool
) -> int:
    """Prompt tokens computed when each prompt is served in turn with its output (the tokens generated, or how many:
    then ids no prompt has), on one pool."""
    pool = KVPool(_TINY, block_size, torch.float32, huge_pages=False, prefix_caching=caching)
    pool.add_segment(pool_tokens // block_size)
    sched = Scheduler(pool, max_batch_size=1, max_num_tokens=1 << 20)
    fresh = itertools.count(1 << 30)  # output token ids no prompt has: generated blocks are never shared here
    total = 0
    for i, (ids, answer) in enumerate(zip(prompts, outputs)):
        n_out = len(answer) if isinstance(answer, list) else answer
        generated = iter(answer) if isinstance(answer, list) else fresh
        req = Request(str(i), ids, SamplingParams(max_tokens=max(1, n_out)), RequestTimings(arrival=float(i)))
        sched.add(req)
        while req.num_output < n_out or req.num_computed < len(ids):
            out = sched.schedule()
            if not out.scheduled:
                raise RuntimeError(f"turn {i} ({len(ids)} + {n_out} tokens) does not fit a {pool_tokens}-token pool")
            for r, n in out.scheduled:
                total += n if r.num_output == 0 else 0
                r.num_computed += n
                pool.cache.cache_computed(r)
                if r.num_computed == r.num_tokens:
                    r.token_ids.append(next(generated, 0))
        sched.finish(req)
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="conv-kv", choices=sorted(KINDS))
    ap.add_argument("--rate-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-turns", type=float, default=4.0)
    ap.add_argument("--max-context", type=int, default=1024, help="tokens a conversation may reach (prompt + output)")
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=0, help="first N turns only (0: all)")
    args = ap.parse_args(argv)
    kind = KINDS[args.kind]
    reqs, shaping = kind.requests(args.rate_scale, args.seed)
    conv = Conversations(args.mean_turns, args.max_context)
    turns = conv.turns(reqs, args.seed)[: args.limit or None]
    source = PromptSource(load_tokenizer())
    planned = plan_turns(turns, source)
    print(kind.describe())
    print(shaping.describe())
    print(conv.describe())
    print(
        f"{len(planned)} turns in {len({t.conversation for t in turns})} conversations; pool {args.pool_tokens} "
        f"tokens, block {args.block_size}"
    )
    open_prompts = [source.tok.encode(p.prompt) for p in planned]
    chat_prompts, answers = chat_tokens(turns, source)
    for client, prompts, outputs in (
        ("open", open_prompts, [p.output_tokens for p in planned]),
        ("chat", chat_prompts, answers),
    ):
        on = prefilled(prompts, outputs, args.pool_tokens, args.block_size, caching=True)
        off = prefilled(prompts, outputs, args.pool_tokens, args.block_size, caching=False)
        print(
            f"{client}: prompt tokens {off} (median {sorted(map(len, prompts))[len(prompts) // 2]}), prefilled "
            f"with reuse {on}: {1 - on / off:.1%} fewer"
        )


def chat_tokens(turns, source) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, answer ids) per turn for the chat client: the conversation's earlier messages and the server's
    answers as tokens, then the new message (the messages and answers plan_turns cuts from the corpus)."""
    history: dict[int, list[int]] = {}
    prompts, answers = [], []
    for t in turns:
        key = 2 * (1000 * t.conversation + t.turn)
        message = source.tok.encode(source.prompt(key, t.message_tokens)[0])
        answer = source.tok.encode(source.prompt(key + 1, t.output_tokens)[0])
        prompts.append(history.get(t.conversation, []) + message)
        answers.append(answer)
        history[t.conversation] = prompts[-1] + answer
    return prompts, answers


if __name__ == "__main__":
    main()
