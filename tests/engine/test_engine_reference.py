"""The engine against an independent reference: transformers' own GGUF loader on the same file."""

import pytest
import torch
from tests.engine_fixtures import make_engine

from engines.gguf_import import embedded_model_path
from trtllm_backend.attention import AttentionPlan, SeqSlice
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def corpus_window(engine, n=256) -> list[int]:
    text = (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering "
        "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters. "
    ) * 4
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def engine_logits(engine, ids: list[int]) -> torch.Tensor:
    """All-position logits through the paged path (one prefill over a fresh block table)."""
    n = len(ids)
    blocks = engine.pool.allocate(-(-n // engine.pool.block_size))
    try:
        plan = AttentionPlan(engine.pool, [SeqSlice(0, n, n, blocks)])
        with torch.inference_mode():
            return engine.model.forward(torch.tensor(ids), torch.arange(n), plan, torch.arange(n))
    finally:
        engine.pool.free(blocks)


def test_logits_match_transformers_gguf_loader(engine):
    # Reference: transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) in fp32, the same GGUF.
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = corpus_window(engine)
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0].float()
    got = engine_logits(engine, ids)
    rel = (got - expected).abs().max() / expected.abs().max()
    print(f"max relative logit difference over {len(ids)} tokens: {rel:.2e}")
    assert rel < 1e-3


def test_capital_of_france_is_paris(engine):
    out = "".join(o.text for o in engine.generate("The capital of France is", SamplingParams(max_tokens=4)))
    assert out.startswith(" Paris")


def step_logits(engine, prompt: str, steps: int) -> list[torch.Tensor]:
    """The logits of each of `steps` greedy steps after `prompt` (prefill's last row, then decode steps)."""
    rows = []
    engine.on_logits = lambda rid, row: rows.append(row.clone())
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=steps, ignore_eos=True), lambda o: None)
        engine.run_until_idle()
    finally:
        engine.on_logits = None
    return rows


def test_decode_matches_full_prefill_logits(engine):
    """Paged decode (one token at a time over block tables) agrees with a prefill of the same tokens."""
    ids = corpus_window(engine, 40)
    full = engine_logits(engine, ids)
    steps = []
    engine.on_logits = lambda rid, row: steps.append(row.clone())
    engine.add_request(engine.tokenizer.decode(ids[:30]), SamplingParams(max_tokens=1), lambda o: None)
    engine.run_until_idle()
    engine.on_logits = None
    rel = (
        steps[0] - full[len(engine.tokenizer.encode(engine.tokenizer.decode(ids[:30]))) - 1]
    ).abs().max() / full.abs().max()
    assert rel < 1e-4


def test_fp16_weight_storage_halves_the_weights_and_keeps_the_logits(engine):
    # weight_dtype=float16: the same fragments rounded to fp16 at load, computed in fp32. The rounding moves
    # a weight by at most 2^-11 of itself, so the logits stay close to the fp32 engine's (and greedy output too).
    half = make_engine(weight_dtype="float16")
    assert half.model.lm_head.dtype == torch.float16 and half.model.norm.dtype == torch.float32
    assert half.model.slots[0].weights.qkv.weight.dtype == torch.float16
    ratio = half.model.weights_nbytes / engine.model.weights_nbytes
    assert 0.49 < ratio < 0.51, ratio
    ids = corpus_window(engine, 64)
    ref, got = engine_logits(engine, ids), engine_logits(half, ids)
    rel = (got - ref).abs().max() / ref.abs().max()
    print(f"fp16 weights: max relative logit difference {rel:.2e}")
    assert rel < 1e-2
    out = "".join(o.text for o in half.generate("The capital of France is", SamplingParams(max_tokens=4)))
    assert out.startswith(" Paris")


def test_bf16_weight_storage_keeps_the_bytes_of_fp16_and_the_logits_close(engine):
    # weight_dtype=bfloat16: the fragments rounded to bf16 at load, and every dense matmul rounds its input to bf16
    # and sums in fp32 (vLLM-CPU's numerics for them); norms, attention and the residual stream stay fp32. bf16
    # keeps 8 bits of mantissa against fp16's 11, so the logits move more than fp16 storage's but stay close.
    bf = make_engine(weight_dtype="bfloat16")
    assert bf.model.lm_head.dtype == torch.bfloat16 and bf.model.norm.dtype == torch.float32
    assert bf.model.slots[0].weights.qkv.weight.dtype == torch.bfloat16
    assert 0.49 < bf.model.weights_nbytes / engine.model.weights_nbytes < 0.51
    ids = corpus_window(engine, 64)
    ref, got = engine_logits(engine, ids), engine_logits(bf, ids)
    rel = (got - ref).abs().max() / ref.abs().max()
    print(f"bf16 weights: max relative logit difference {rel:.2e}")
    assert 0 < rel < 5e-2
    prompt = engine.tokenizer.decode(ids[:30])
    # prefill's last row, then decode steps (the bf16 kernel, fused where it applies)
    for a, b in zip(step_logits(engine, prompt, 6), step_logits(bf, prompt, 6), strict=True):
        finite = torch.isfinite(a)  # ignore_eos masks the EOS logits in both
        assert (b[finite] - a[finite]).abs().max() / a[finite].abs().max() < 5e-2
    out = "".join(o.text for o in bf.generate("The capital of France is", SamplingParams(max_tokens=4)))
    assert out.startswith(" Paris")


def test_fp16_kv_cache_halves_each_block_and_keeps_prefill_and_decode_logits(engine):
    # kv_cache_dtype=float16: K/V rounded to fp16 when written to the pool, widened when read (compute in fp32).
    # Each block costs half the bytes; the logits stay close to the fp32 pool's, through prefill and through
    # paged decode steps (the C++ decode kernel reading fp16 slots), and greedy output is unchanged.
    half = make_engine(kv_cache_dtype="float16")
    assert half.pool.dtype == torch.float16
    assert half.pool.bytes_per_block * 2 == engine.pool.bytes_per_block
    assert half.pool.num_blocks == engine.pool.num_blocks  # the same tokens in half the memory
    ids = corpus_window(engine, 64)
    ref, got = engine_logits(engine, ids), engine_logits(half, ids)
    rel = (got - ref).abs().max() / ref.abs().max()
    print(f"fp16 KV, prefill: max relative logit difference {rel:.2e}")
    assert 0 < rel < 1e-2
    prompt = engine.tokenizer.decode(ids[:30])
    steps = {"fp32": step_logits(engine, prompt, 8), "fp16": step_logits(half, prompt, 8)}
    assert len(steps["fp32"]) == len(steps["fp16"]) == 8
    for a, b in zip(steps["fp32"], steps["fp16"]):  # prefill's last row, then decode steps over the pool
        finite = torch.isfinite(a)  # ignore_eos masks the EOS logits in both
        assert torch.equal(finite, torch.isfinite(b))
        assert (b[finite] - a[finite]).abs().max() / a[finite].abs().max() < 1e-2
    assert [r.argmax() for r in steps["fp32"]] == [r.argmax() for r in steps["fp16"]]
