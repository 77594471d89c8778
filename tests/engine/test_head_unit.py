"""The tied embedding / LM head as a morph unit on the real model: its INT8 fragment beside the layer fragments,
its rank in the swap order, its swap and restore like a layer's (the freed bytes as KV blocks), its logits.

Needs the INT4 fragments and the profiled swap order that `make setup` builds; the head's fragment is built here
into an overlay of that set (the set itself may be read-only)."""

import pytest
import torch
from tests.engine_fixtures import PROMPTS, fragment_dir

from engines import layer_importance
from engines.build_fragments import build_head_int8, head_file, link_set
from plugins.quant_matmul import quantize_int8
from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.fragments import HEAD_TENSOR, read_safetensors
from trtllm_backend.manifest import HEAD_UNIT, Manifest
from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams


@pytest.fixture(scope="module")
def head_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("fragments") / "with_head"
    link_set(fragment_dir(), out)
    build_head_int8(out)
    return out


def engine_on(path, **overrides) -> LLMEngine:
    overrides.setdefault("morph_policy", "full")
    overrides.setdefault(
        "lm_head_precision", "dynamic"
    )  # the head as a morph unit (int8 static: test_memory_budget.py)
    return LLMEngine(EngineConfig(fragment_dir=str(path), **overrides))


@pytest.mark.needs_model
def test_the_fragment_sits_beside_the_layer_fragments(head_set):
    src, m = Manifest(fragment_dir()), Manifest(head_set)
    assert m.head_precisions() == ["full", "int8"] and m.head_swappable()
    assert m.data["layers"] == src.data["layers"] and m.swap_order() == src.swap_order()  # the layers untouched
    if not src.head_swappable():  # a set from before the head unit (setup now builds it into the set)
        assert src.unit_order() == src.swap_order() and not (src.dir / head_file(Precision.INT8)).exists()
    path = m.verified_path(m.head_fragment(Precision.INT8))
    assert not path.is_symlink()
    tensors = read_safetensors(path)
    ref = quantize_int8(read_safetensors(src.verified_path(src.data["shared"]))["model.embed_tokens.weight"])
    assert torch.equal(tensors[HEAD_TENSOR + ".weight"], ref["weight"])
    assert torch.equal(tensors[HEAD_TENSOR + ".scales"], ref["scales"].float())
    # its place: where the greedy would have picked it, by the same score
    head = m.data[HEAD_UNIT]
    rank, rounds = head["swap_rank"], m.data["swap_order_profile"]["rounds"]
    score = head["rank_profile"]
    assert rounds and 0 <= rank <= len(rounds)
    assert score["lis"] == pytest.approx((0.25 * score["lrs"] + 0.5 * score["mds"]) / 0.75)
    if rank < len(rounds):  # it beats the round it goes before...
        assert score["lis"] >= rounds[rank]["lis"]
    if rank > 0:  # ...and not the round before that, scored again here: the first round it beats
        assert _head_scores_at(head_set, rank - 1)["lis"] < rounds[rank - 1]["lis"]
    order = m.unit_order()
    assert order[rank] == HEAD_UNIT and [u for u in order if u != HEAD_UNIT] == m.swap_order()


def _head_scores_at(path, k: int) -> dict:
    """The head's scores with the first k layers of the swap order quantized, on the text the order was profiled
    on (as engines.build_fragments.score_head_rank reads it)."""
    from engines.build_fragments import REPO_ROOT
    from engines.offline_model import OfflineModel, corpus_tokens
    from trtllm_backend.tokenizer import Tokenizer

    profile = Manifest(path).data["swap_order_profile"]
    model = OfflineModel(path, max_len=profile["seq_len"])
    corpus = REPO_ROOT.parent / "shared" / "data" / "corpus" / profile["corpus"]
    ids = corpus_tokens(Tokenizer(model.manifest), corpus, 0.0, 0.5, profile["samples"], profile["seq_len"])
    return layer_importance.head_scores(model, ids, model.manifest.swap_order()[:k])


def test_head_rank_is_the_first_round_the_head_beats(monkeypatch):
    lis = {0: 0.90, 1: 0.95, 2: 0.99}  # the head's LIS against the set of the first k layers
    monkeypatch.setattr(layer_importance, "head_scores", lambda m, ids, q: {"lis": lis[len(q)]})
    rounds = [{"lis": 0.97}, {"lis": 0.96}]
    assert layer_importance.head_rank(None, None, [5, 3], rounds) == (2, {"lis": 0.99})
    lis[1] = 0.96  # a tie goes to the head
    assert layer_importance.head_rank(None, None, [5, 3], rounds)[0] == 1
    with pytest.raises(ValueError, match="rounds"):
        layer_importance.head_rank(None, None, [5, 3], rounds[:1])


@pytest.mark.needs_model
def test_swap_frees_the_table_as_kv_blocks_and_restores(head_set):
    prompts = PROMPTS[:2]
    base = engine_on(head_set, weight_dtype="float16")
    engine = engine_on(
        head_set, weight_dtype="float16", max_tokens_in_paged_kv_cache=1024, force_morph="down:1@4,up:1@16"
    )
    m, model = engine.morph, engine.model
    assert m.order[m.order.index(HEAD_UNIT)] == HEAD_UNIT and m.reserve >= m.down_bytes[HEAD_UNIT]
    base_blocks, r0, full = engine.pool.num_blocks, m.account.available, model.head.nbytes
    seen = []  # (iteration, head precision, KV blocks, violations) after each step
    outs = {f"p{i}": [] for i in range(len(prompts))}
    ref = {f"p{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        engine.add_request(p, params, lambda o, r=f"p{i}": outs[r].extend(o.token_ids), request_id=f"p{i}")
        base.add_request(p, params, lambda o, r=f"p{i}": ref[r].extend(o.token_ids), request_id=f"p{i}")
    base.run_until_idle()
    while True:  # run_until_idle and settle_morph in one loop, looking at the state after every step
        engine.step()
        seen.append(
            (engine.counters.iterations, model.head.precision, engine.pool.num_blocks, engine.check_invariants())
        )
        if not (engine.scheduler.has_work() or engine.morph.busy(engine.counters.iterations)):
            break
        engine.morph.wait(0.05)
    int8 = [s for s in seen if s[1] == Precision.INT8]
    assert int8, "the head was never swapped"
    freed = full - engine.store.load_head(Precision.INT8).nbytes  # fp16 table -> int8 rows + fp32 scales
    assert max(b for _, _, b, _ in int8) - base_blocks == (freed + r0) // engine.pool.bytes_per_block > 0
    assert all(not v for *_, v in seen), [v for *_, v in seen if v][:1]
    c = engine.counters
    assert (c.swaps_down, c.swaps_up, c.swap_failures) == (1, 1, 0) and engine.morph.int4_layers == 0
    assert model.head.precision == Precision.FULL and engine.pool.num_blocks == base_blocks
    assert engine.stats().lm_head_int8 == 0 and engine.stats().swaps_timed == 2
    first = int8[0][0]  # tokens sampled before the swap are the full-precision ones
    for rid in outs:
        assert len(outs[rid]) == 24 and outs[rid][:first] == ref[rid][:first]


@pytest.mark.needs_model
def test_int8_head_logits_track_the_full_head(head_set):
    def first_logits(engine):
        rows = {}
        engine.on_logits = lambda rid, row: rows.setdefault(rid, row.clone())
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, SamplingParams(max_tokens=1), lambda o: None, request_id=f"p{i}")
        engine.run_until_idle()
        return rows

    full = first_logits(engine_on(head_set))
    quant = engine_on(head_set, morph_policy="int4:1")  # one unit, the first in the order: the head
    assert quant.model.head.precision == Precision.INT8 and quant.morph.int4_layers == 0
    assert quant.stats().lm_head_int8 == 1 and not quant.check_invariants()
    q = first_logits(quant)
    for rid in full:
        cos = torch.nn.functional.cosine_similarity(full[rid], q[rid], dim=0)
        assert cos > 0.999, (rid, float(cos))  # measured 0.9997 (the INT8 embedding feeds every layer too)
        top = torch.topk(full[rid], 2).values
        if float(top[0] - top[1]) > 0.05:  # no near tie: the same greedy token
            assert int(full[rid].argmax()) == int(q[rid].argmax()), rid


@pytest.mark.needs_model
def test_static_int4_takes_every_unit(head_set):
    engine = engine_on(head_set, morph_policy="int4")
    m = engine.morph
    assert m.morphed_units == 31 and m.int4_layers == 30 and m.head_int8
    assert not engine.check_invariants()
    outs = list(engine.generate("The capital of France is", SamplingParams(max_tokens=4)))
    assert sum(len(o.token_ids) for o in outs) == 4


@pytest.mark.needs_model
def test_a_corrupt_head_fragment_at_swap_time_keeps_serving(head_set, tmp_path):
    dst = tmp_path / "damaged"
    link_set(head_set, dst)
    victim = dst / head_file(Precision.INT8)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.unlink()
    victim.write_bytes(data)
    engine = engine_on(dst, force_morph="down:2@1")
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True), lambda o: None)
    engine.run_until_idle()
    assert engine.settle_morph(timeout_s=120)
    c = engine.counters
    assert c.swap_failures == 1 and engine.model.head.precision == Precision.FULL and HEAD_UNIT in engine.morph.failed
    assert engine.morph.int4_layers == 1  # the action's other unit: the next in the order
    assert not engine.check_invariants()


@pytest.mark.needs_model
def test_the_head_is_timed_at_load_for_the_decode_time_pressure(head_set):
    m = engine_on(head_set, morph_policy="balanced", morph_overrides={"down_tpot_s": 0.05}).morph
    assert set(m.speedup) == {"layer", "lm_head"} and all(r > 0 for r in m.speedup["lm_head"].values())
    m.speedup = {"layer": {32: 0.5}, "lm_head": {32: 2.0}}
    assert m.swap_speeds_up(1) == (m.order[0] == HEAD_UNIT)  # the next unit's own measurement decides
