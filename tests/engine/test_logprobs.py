"""Log probabilities: the picking function against a plain reference, and the engine's per-token and prompt
logprobs against log_softmax of the very logits it sampled from (the on_logits hook), across chunked prefill."""

from __future__ import annotations

import math

import pytest
import torch
from tests.engine_fixtures import PROMPTS, make_engine

from trtllm_backend.errors import InvalidRequest
from trtllm_backend.logprobs import log_probs, pick
from trtllm_backend.sampling import SamplingParams


def test_pick_matches_a_plain_log_softmax_and_sorts_alternatives():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 1.0, 5.0, 0.0]])
    ref = torch.log_softmax(logits.double(), dim=-1)
    got = pick(log_probs(logits), [0, 2], [2, 0])
    assert got[0].token_id == 0 and math.isclose(got[0].logprob, ref[0, 0].item(), abs_tol=1e-6)
    assert [t for t, _ in got[0].top] == [1, 2]
    assert all(math.isclose(v, ref[0, t].item(), abs_tol=1e-6) for t, v in got[0].top)
    assert got[1].top == () and math.isclose(got[1].logprob, ref[1, 2].item(), abs_tol=1e-6)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_logprob_counts_out_of_range_are_refused_by_name(value):
    with pytest.raises(InvalidRequest, match="^logprobs"):
        SamplingParams(logprobs=value)


@pytest.mark.needs_model
def test_engine_logprobs_are_log_softmax_of_the_sampled_logits():
    engine = make_engine(max_num_tokens=8)  # prompts of 20+ tokens prefill in several chunks
    rows: dict[str, list[torch.Tensor]] = {}
    engine.on_logits = lambda rid, row: rows.setdefault(rid, []).append(row.clone())
    outs: dict[str, list] = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=0.8, seed=i)
        engine.add_request(
            prompt, params, lambda o, rid=f"r{i}": outs.setdefault(rid, []).append(o), request_id=f"r{i}"
        )
    engine.run_until_idle()
    for rid, pieces in outs.items():
        entries = [lp for o in pieces for lp in o.logprobs]
        tokens = [t for o in pieces for t in o.token_ids]
        assert [e.token_id for e in entries] == tokens
        for entry, row in zip(entries, rows[rid]):
            ref = torch.log_softmax(row.double(), dim=-1)
            assert math.isclose(entry.logprob, ref[entry.token_id].item(), abs_tol=1e-4)
            assert [t for t, _ in entry.top] == torch.topk(ref, 3).indices.tolist()
        assert math.isclose(pieces[-1].cumulative_logprob, sum(e.logprob for e in entries), abs_tol=1e-4)
        prompt = pieces[0].prompt_logprobs
        assert prompt[0] is None and len(prompt) == pieces[0].num_prompt_tokens
        assert all(e.logprob <= 0 and len(e.top) == 2 for e in prompt[1:])
        assert all(o.prompt_logprobs is None for o in pieces[1:])


@pytest.mark.needs_model
def test_prompt_logprobs_score_the_tokens_a_decode_made():
    """Greedy tokens decoded one at a time, then the same ids as a prompt prefilled in chunks: the prompt's
    scores of those tokens are the decode's (different kernels: fp32 tolerance)."""
    engine = make_engine(max_num_tokens=8)
    prompt = PROMPTS[0]
    out = list(engine.generate(prompt, SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True)))
    decoded = [lp for o in out for lp in o.logprobs]
    ids = engine.tokenizer.encode(prompt) + [lp.token_id for lp in decoded]
    text = prompt + engine.tokenizer.decode([lp.token_id for lp in decoded])
    if engine.tokenizer.encode(text) != ids:
        pytest.skip("the text does not re-encode to the same ids")
    first = next(engine.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    scored = first.prompt_logprobs[-len(decoded) :]
    for a, b in zip(scored, decoded):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=2e-3), (a, b)
