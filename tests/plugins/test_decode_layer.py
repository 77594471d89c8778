"""The fused decode layer (plugins/decode_layer.py, csrc/decode_layer.cpp) against the per-op path it replaces:
bitwise the same output and K/V writes for dense fp32, fp16- and bf16-stored and INT4 layers, on 1 and 2 threads; a row's
result independent of its batch; bad input rejected before anything is written; fallbacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.engine_fixtures import random_layer_tensors
from tests.plugins.test_cpu_kernels import CFG, _decode_plan, _fused_inputs, _pool_with_sequences, needs_kernels, ns

from plugins import decode_layer as fused
from plugins import skinny_gemm
from plugins.quant_matmul import Int4Linear, Int8Linear
from trtllm_backend.layers import LayerSlot, LayerWeights, dense_layer

G = 16  # INT4 group size that divides the test config's 48 and 64 inputs


def _tensors(seed: int = 11, cfg=CFG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return random_layer_tensors(cfg, g)


def _layer(kind: str, cfg=CFG) -> LayerWeights:
    t = _tensors(cfg=cfg)
    if kind == "fp32":
        return dense_layer(t, torch.float32)
    if kind == "fp16":
        return dense_layer(t, torch.float32, torch.float16)
    if kind == "bf16":
        if not skinny_gemm.bf16_kernel_available():
            pytest.skip("this CPU lacks AVX512_BF16: bf16-stored weights run on torch, op by op")
        return dense_layer(t, torch.float32, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    w = {k.removesuffix(".weight").split(".")[-1]: v for k, v in t.items()}
    if kind == "int8":
        make = lambda ws, pre_scale=None: Int8Linear.from_float(torch.cat(ws))  # noqa: E731
        pre_o = pre_down = None
    else:  # INT4 with AWQ-like pre-scales on o and down, as the fragments have
        make = lambda ws, pre_scale=None: Int4Linear.fused(ws, G, pre_scale)  # noqa: E731
        pre_o, pre_down = (
            torch.rand(cfg.num_heads * cfg.head_dim, generator=g) + 0.5,
            torch.rand(cfg.intermediate_size, generator=g) + 0.5,
        )
    return LayerWeights(
        input_layernorm=t["input_layernorm.weight"],
        post_attention_layernorm=t["post_attention_layernorm.weight"],
        qkv=make([w["q_proj"], w["k_proj"], w["v_proj"]]),
        o=make([w["o_proj"]], pre_o),
        gate_up=make([w["gate_proj"], w["up_proj"]]),
        down=make([w["down_proj"]], pre_down),
    )


def _run(
    weights: LayerWeights,
    lens: list[int],
    use_fused: bool,
    monkeypatch,
    threads: int = 1,
    rows=None,
    expect_fused: bool | None = None,
    cfg=CFG,
    kv_dtype: torch.dtype = torch.float32,
):
    """One decode step of layer 1 over sequences `lens` on a fresh pool: (output, the pool's segments)."""
    monkeypatch.setenv("MORPHSERVE_FUSED_DECODE", "1" if use_fused else "0")
    calls = []
    real = fused.decode_layers
    monkeypatch.setattr(fused, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    pool, tables = _pool_with_sequences(lens, dtype=kv_dtype, cfg=cfg)
    h = torch.randn(len(lens), cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    _, cos, sin = _fused_inputs(lens, cfg=cfg)
    rows = list(range(len(lens))) if rows is None else rows
    plan = _decode_plan(pool, [tables[r] for r in rows], [lens[r] for r in rows])
    assert plan.fused_decode
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = LayerSlot(1, cfg, weights).forward(h[rows], cos[rows], sin[rows], plan)
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(fused, "decode_layers", real)
    assert bool(calls) == (use_fused if expect_fused is None else expect_fused), "fused op use not as expected"
    return out, [s.kv.clone() for s in pool.segments]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])  # 1-4 rows: each thread does every row's row-wise work; 5: split
@pytest.mark.parametrize("kind", ["fp32", "fp16", "bf16", "int4"])
@pytest.mark.parametrize("lens", [[9], [4, 13], [4, 13, 22, 1, 30]])
def test_fused_layer_is_bitwise_the_per_op_layer(kind, lens, threads, monkeypatch):
    weights = _layer(kind)
    ref, ref_kv = _run(weights, lens, False, monkeypatch, threads)
    got, got_kv = _run(weights, lens, True, monkeypatch, threads)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, ref_kv))  # the same new K/V in the same slots


# SmolLM2's attention heads: 9 query heads over 3 KV heads of 64 (4 keys a pass, the 3 heads' values at once), at
# contexts where the K/V rows are prefetched ahead; 3 tasks a row over 2 threads.
SMOLLM2_HEADS = dataclasses.replace(CFG, num_heads=9, num_kv_heads=3, head_dim=64)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["fp16", "bf16", "int4"])
@pytest.mark.parametrize("lens", [[70], [20, 30, 25]])
def test_fused_layer_at_smollm2_head_shape_is_bitwise_the_per_op_layer(kind, lens, threads, kv_dtype, monkeypatch):
    weights = _layer(kind, SMOLLM2_HEADS)
    ref, ref_kv = _run(weights, lens, False, monkeypatch, threads, cfg=SMOLLM2_HEADS, kv_dtype=kv_dtype)
    got, got_kv = _run(weights, lens, True, monkeypatch, threads, cfg=SMOLLM2_HEADS, kv_dtype=kv_dtype)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, ref_kv))


@needs_kernels
@pytest.mark.parametrize("kind", ["fp16", "bf16", "int4"])
def test_a_rows_fused_result_does_not_depend_on_its_batch(kind, monkeypatch):
    weights, lens = _layer(kind), [3, 11, 26, 7]
    batched, _ = _run(weights, lens, True, monkeypatch, threads=2)
    for r in range(len(lens)):
        alone, _ = _run(weights, lens, True, monkeypatch, threads=1, rows=[r])
        assert torch.equal(alone[0], batched[r])


@needs_kernels
def test_int8_layers_and_the_switch_keep_the_per_op_path(monkeypatch):
    w = _layer("int8")
    assert fused.layer_args(w.input_layernorm, w.post_attention_layernorm, (w.qkv, w.o, w.gate_up, w.down)) is None
    _run(w, [5, 2], True, monkeypatch, expect_fused=False)  # asked for, but INT8 runs op by op


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_a_stack_of_layers_is_one_call_per_run_of_fusable_layers_and_bitwise_the_per_op_stack(threads, monkeypatch):
    from trtllm_backend.layers import run_layers

    lens = [6, 17, 2]
    stacks = {"all fusable": ["int4", "fp16", "fp32", "int4"], "int8 in the middle": ["fp16", "int8", "int4"]}
    for name, kinds in stacks.items():
        slots = [LayerSlot(i % CFG.num_layers, CFG, _layer(k)) for i, k in enumerate(kinds)]
        outs = {}
        for use in ("0", "1"):
            monkeypatch.setenv("MORPHSERVE_FUSED_DECODE", use)
            calls = []
            real = fused.decode_layers
            monkeypatch.setattr(
                fused, "decode_layers", lambda h, layers, *a: calls.append(len(layers)) or real(h, layers, *a)
            )
            pool, tables = _pool_with_sequences(lens)
            plan = _decode_plan(pool, tables, lens)
            h = torch.randn(len(lens), CFG.hidden_size, generator=torch.Generator().manual_seed(2))
            _, cos, sin = _fused_inputs(lens)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                outs[use] = (run_layers(slots, h, cos, sin, plan), [s.kv.clone() for s in pool.segments], calls)
            finally:
                torch.set_num_threads(before)
                monkeypatch.setattr(fused, "decode_layers", real)
        assert outs["0"][2] == []
        assert outs["1"][2] == ([4] if name == "all fusable" else [1, 1]), name
        assert torch.equal(outs["0"][0], outs["1"][0]), name
        assert all(torch.equal(a, b) for a, b in zip(outs["0"][1], outs["1"][1])), name


@pytest.mark.needs_model
@needs_kernels
def test_engine_decode_logits_are_bitwise_the_same_fused_or_not(monkeypatch):
    from tests.engine_fixtures import PROMPTS, make_engine

    from trtllm_backend.sampling import SamplingParams

    # fp32: the logits the reference tests hold to transformers'. No prefix cache: the second pass would reuse the
    # first pass's prompt blocks, and a shorter prefill chunk moves the last bits (prefix_cache.py).
    engine = make_engine(enable_prefix_caching=False)
    rows, calls = {}, []
    real = fused.decode_layers
    monkeypatch.setattr(fused, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    for use in ("0", "1"):
        monkeypatch.setenv("MORPHSERVE_FUSED_DECODE", use)
        rows[use] = []
        engine.on_logits = lambda rid, row: rows[use].append((rid, row.clone()))
        for i, p in enumerate(PROMPTS[:3]):
            engine.add_request(
                p, SamplingParams(max_tokens=5, ignore_eos=True), lambda o: None, request_id=f"{use}-{i}"
            )
        engine.run_until_idle()
        assert bool(calls) == (use == "1")
    engine.on_logits = None
    assert len(rows["1"]) == len(rows["0"]) == 15
    assert all(a[0][2:] == b[0][2:] and torch.equal(a[1], b[1]) for a, b in zip(rows["0"], rows["1"]))


@needs_kernels
def test_fused_layer_rejects_bad_input_before_writing():
    w = _layer("fp16")
    tensors, meta = fused.layer_args(w.input_layernorm, w.post_attention_layernorm, (w.qkv, w.o, w.gate_up, w.down))
    lens = [5]
    pool, tables = _pool_with_sequences(lens)
    plan = _decode_plan(pool, tables, lens)
    _, segments, seg_of, slot_of, lens_t = plan.decode_kernel
    h = torch.randn(1, CFG.hidden_size)
    _, cos, sin = _fused_inputs(lens)
    before = [s.kv.clone() for s in pool.segments]
    op = ns.decode_layers

    def call(tensors=tensors, meta=meta, layers=(1,), h=h, cos=cos, slot_of=slot_of, heads=CFG.num_heads):
        return op(h, tensors, meta, list(layers), cos, sin, segments, seg_of, slot_of, lens_t, 0.3, heads, 1e-5)

    with pytest.raises(RuntimeError, match="14 weight tensors and 12 meta ints per layer expected for 1 layers"):
        call(meta=meta[:-1])
    with pytest.raises(RuntimeError, match="expected for 2 layers"):
        call(layers=(0, 1))
    with pytest.raises(RuntimeError, match="layer 2 out of range"):
        call(tensors=tensors * 2, meta=meta * 2, layers=(1, 2))
    with pytest.raises(RuntimeError, match="unknown kind 7"):
        call(meta=[7] + meta[1:])
    with pytest.raises(RuntimeError, match="layer 1 qkv weight must be a contiguous fp32, fp16 or bf16"):
        call(tensors=tensors[:2] + [tensors[2].t()] + tensors[3:])
    with pytest.raises(RuntimeError, match="points outside the pool"):
        call(slot_of=torch.full_like(slot_of, 999))
    with pytest.raises(RuntimeError, match="do not group"):
        call(heads=5)
    with pytest.raises(RuntimeError, match="fp32 CPU h"):
        call(h=h.double())
    with pytest.raises(RuntimeError, match=r"cos and sin \[1, 4\]"):
        call(cos=cos[:, :3])
    assert all(torch.equal(a, s.kv) for a, s in zip(before, pool.segments))  # nothing written
    call()
    assert not all(torch.equal(a, s.kv) for a, s in zip(before, pool.segments))  # a valid call writes the new K/V


@needs_kernels
def test_the_run_cache_flattens_once_per_binding_and_a_rebind_drops_it(monkeypatch):
    from trtllm_backend.layers import run_layers

    monkeypatch.setenv("MORPHSERVE_FUSED_DECODE", "1")
    lens = [6, 17, 2]
    runs = fused.RunCache()
    slots = [LayerSlot(i % CFG.num_layers, CFG, _layer(k), runs=runs) for i, k in enumerate(["int4", "fp16"])]
    flattened = []
    real = fused._flatten
    monkeypatch.setattr(fused, "_flatten", lambda layers: flattened.append(len(layers)) or real(layers))

    def run(cache):
        pool, tables = _pool_with_sequences(lens)
        plan = _decode_plan(pool, tables, lens)
        h = torch.randn(len(lens), CFG.hidden_size, generator=torch.Generator().manual_seed(3))
        _, cos, sin = _fused_inputs(lens)
        return run_layers(slots, h, cos, sin, plan, cache)

    first, again = run(runs), run(runs)
    assert flattened == [2] and torch.equal(first, again)  # flattened once, then reused
    assert torch.equal(first, run(None))  # the same as flattening every call
    slots[1].bind(_layer("int4"), "int4")  # a rebind drops the cache: the new weights are used
    assert torch.equal(run(runs), run(None)) and flattened == [2, 2, 2, 2]
    assert not torch.equal(run(runs), first)
