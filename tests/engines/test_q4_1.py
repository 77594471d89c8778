"""Q4_1 fragments: a GGUF's own 4-bit blocks (fp16 scale d and min m per 32 weights) kept exactly and run by the INT4
kernels (plugins/quant_matmul.py, csrc/int4_linear.cpp, engines/gguf_q4_1.py), and morph_policy=q4_1.

Bitwise: the blocks re-laid, dequantized in Python and by the kernel, are gguf's own dequantization; the layer's
full fragment (the same GGUF dequantized) is that too. The matmuls agree with the fp32 reference to rounding, the
fused decode layer is bitwise the per-op one, and the AWQ form is unchanged beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tests.plugins.test_cpu_kernels import needs_kernels, ns
from tests.plugins.test_decode_layer import _run, _tensors

from engines.gguf_q4_1 import q4_1_rows
from plugins import cpu_kernels, quant_matmul, skinny_gemm
from plugins.quant_matmul import Int4Linear, dequantize_q4_1, quantize_int4
from trtllm_backend.controller import is_policy_spec, parse_policy
from trtllm_backend.layers import LayerWeights
from trtllm_backend.precision import Precision

Q41 = GGMLQuantizationType.Q4_1


def _gguf_bytes(n: int, k: int, seed: int, edge: bool = True) -> np.ndarray:
    """A Q4_1 tensor's bytes [n, k/32 * 20] as gguf writes them, plus blocks with edge values: a zero scale,
    subnormal and negative scales and mins, every nibble value."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).numpy()
    raw = quantize(w, Q41).reshape(n, k // 32, 20)
    if edge and n >= 2 and k >= 64:
        raw[0, 0, :4] = np.array([0.0, -0.5], dtype=np.float16).view(np.uint8)  # d = 0: every weight is m
        raw[1, 0, :4] = np.array([6e-8, -6e-8], dtype=np.float16).view(np.uint8)  # subnormal d and m
        raw[1, 1, :4] = np.array([-0.01, 3.5], dtype=np.float16).view(np.uint8)  # a negative scale
        raw[0, 1, 4:] = np.arange(16, dtype=np.uint8) * 17  # nibbles 0..15 in both halves
    return raw.reshape(n, -1)


def _portable(raw: np.ndarray, n: int, k: int) -> dict[str, torch.Tensor]:
    q, dm = q4_1_rows(raw, n, k)
    return {"qweight": q, "scales_mins": dm}


def _reference(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, Q41).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("n,k", [(960, 576), (7, 1536), (3, 32)])
def test_the_blocks_re_laid_dequantize_to_ggufs_weights_bit_for_bit(n, k):
    raw = _gguf_bytes(n, k, seed=n)
    t = _portable(raw, n, k)
    assert t["qweight"].shape == (n, k // 2) and t["qweight"].dtype == torch.uint8
    assert t["scales_mins"].shape == (n, k // 32, 2) and t["scales_mins"].dtype == torch.float16
    # d and m are the file's bits, untouched
    file_dm = np.ascontiguousarray(raw.reshape(n, k // 32, 20)[..., :4]).view(np.float16)
    assert np.array_equal(t["scales_mins"].numpy().view(np.uint16), file_dm.view(np.uint16))
    assert torch.equal(dequantize_q4_1(t), _reference(raw, n, k))


@needs_kernels
@pytest.mark.parametrize("n,k", [(960, 576), (100, 1536), (7, 64), (1, 32)])  # full tiles, tails, one row
def test_the_kernels_packing_dequantizes_to_ggufs_weights_bit_for_bit(n, k):
    raw = _gguf_bytes(n, k, seed=k)
    op = Int4Linear(_portable(raw, n, k))
    assert op.q4_1 and op.group_size == 32
    assert op._scales_zeros.dtype == torch.float16 and op._scales_zeros.numel() == 0  # the form's tag
    assert torch.equal(ns.int4_dequantize(op._packed, op._scales_zeros, n, 32), _reference(raw, n, k))
    # the same bytes as the file's blocks: 4 bits per weight and 32 bits of (d, m) per block (rows padded to 8)
    assert op.nbytes == ((n + 7) // 8) * 8 * (k // 2 + k // 32 * 4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, skinny_gemm.MAX_ROWS])
@pytest.mark.parametrize("n,k", [(960, 576), (44, 1536), (7, 64)])
def test_q4_1_decode_rows_with_fp32_activations_match_the_dequantized_matmul(m, n, k, monkeypatch):
    raw = _gguf_bytes(n, k, seed=m + n)
    op, ref = Int4Linear(_portable(raw, n, k)), _reference(raw, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    previous = quant_matmul.set_int4_activations("float32")
    try:
        got = op(x)
    finally:
        quant_matmul.set_int4_activations(previous)
    torch.testing.assert_close(got, (x.double() @ ref.double().t()).float(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_q4_1_prefill_rows_multiply_exactly_the_full_weights():
    """The fp32 prefill path dequantizes and calls the same GEMM as a full-precision weight: the same bits."""
    n, k, m = 960, 576, skinny_gemm.MAX_ROWS + 30
    raw = _gguf_bytes(n, k, seed=5)
    op, ref = Int4Linear(_portable(raw, n, k)), _reference(raw, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    previous = quant_matmul.set_int4_prefill("float32")
    try:
        got = op(x)
    finally:
        quant_matmul.set_int4_prefill(previous)
    assert torch.equal(got, torch.nn.functional.linear(x, ref))


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_q4_1_int8_activations_agree_across_the_avx2_and_vnni_tiles_and_stay_close(m):
    n, k = 960, 576
    raw = _gguf_bytes(n, k, seed=m)
    op, ref = Int4Linear(_portable(raw, n, k)), _reference(raw, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    vnni = {"avx512_vnni", "avx512bw"} <= (cpu_kernels.cpu_flags() or set())
    previous = quant_matmul.set_int4_activations("int8"), ns.int4_vnni(-1)
    try:
        got = {}
        for on in (0, 1) if vnni else (0,):
            ns.int4_vnni(on)
            got[on] = op(x)
    finally:
        quant_matmul.set_int4_activations(previous[0])
        ns.int4_vnni(previous[1])
    assert all(torch.equal(got[0], g) for g in got.values())
    want = x @ ref.t()
    assert ((got[0] - want).norm() / want.norm()).item() < 2e-2  # int8 activations' rounding, nothing more


@needs_kernels
def test_the_awq_form_beside_it_is_unchanged():
    """bf16 (s, z) still means w = (q - 8) s + z: the same nibbles with (d, m) = (s, z - 8 s) in fp16 give another
    weight only through the fp16 rounding of those values."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    t = quantize_int4(w, 32)
    awq = Int4Linear(t)
    assert not awq.q4_1 and awq._scales_zeros.dtype == torch.bfloat16
    assert torch.equal(ns.int4_dequantize(awq._packed, awq._scales_zeros, 64, 32), quant_matmul.dequantize_int4(t))


def test_without_kernels_q4_1_is_dequantized_per_call_and_keeps_its_4bit_bytes(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    n, k = 40, 64
    raw = _gguf_bytes(n, k, seed=3)
    op = Int4Linear(_portable(raw, n, k))
    x = torch.randn(3, k)
    torch.testing.assert_close(op(x), x @ _reference(raw, n, k).t(), rtol=1e-6, atol=1e-6)
    assert op.nbytes == n * k // 2 + n * k // 32 * 4


def _q4_1_from_float(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Q4_1-form tensors of any weight (min/max per `group` inputs, fp16 d and m), for layer shapes gguf's block of
    32 does not divide: the kernel takes the group from the tensors."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    q = (
        ((wg - m.float()[..., None]) / d.float().clamp(min=1e-8)[..., None])
        .round()
        .clamp(0, 15)
        .to(torch.uint8)
        .reshape(n, k)
    )
    return {"qweight": (q[:, 0::2] << 4) | q[:, 1::2], "scales_mins": torch.stack([d, m], -1).contiguous()}


def _q4_1_layer(group: int = 16) -> LayerWeights:
    t = _tensors()
    w = {k.removesuffix(".weight").split(".")[-1]: v for k, v in t.items()}
    make = lambda ws: Int4Linear(_q4_1_from_float(torch.cat(ws), group))  # noqa: E731
    return LayerWeights(
        input_layernorm=t["input_layernorm.weight"],
        post_attention_layernorm=t["post_attention_layernorm.weight"],
        qkv=make([w["q_proj"], w["k_proj"], w["v_proj"]]),
        o=make([w["o_proj"]]),
        gate_up=make([w["gate_proj"], w["up_proj"]]),
        down=make([w["down_proj"]]),
    )


@needs_kernels
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[9], [4, 13, 22]])
def test_a_fused_q4_1_layer_is_bitwise_the_per_op_layer(activations, threads, lens, monkeypatch):
    weights = _q4_1_layer()
    previous = quant_matmul.set_int4_activations(activations)
    try:
        ref, ref_kv = _run(weights, lens, False, monkeypatch, threads)
        got, got_kv = _run(weights, lens, True, monkeypatch, threads)
    finally:
        quant_matmul.set_int4_activations(previous)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, ref_kv))


def test_the_q4_1_policy_is_static_and_binds_the_layers_to_q4_1():
    assert is_policy_spec("q4_1") and is_policy_spec(" Q4_1 ")
    p = parse_policy("q4_1", 31)
    assert not p.dynamic and p.static_int4_layers == 0 and p.max_int4_layers == 0
    assert Precision(p.base_precision) == Precision.Q4_1
    assert parse_policy("full", 30).base_precision == Precision.FULL == parse_policy("balanced", 30).base_precision


# ---------------------------------------------------------------- the real model (its GGUF and fragments)


@pytest.fixture(scope="module")
def q41_set(tmp_path_factory):
    """The real fragment set overlaid with its Q4_1 fragments (its other files linked)."""
    from tests.engine_fixtures import fragment_dir

    from engines.build_fragments import link_set
    from engines.gguf_q4_1 import write_q4_1

    out = tmp_path_factory.mktemp("q41") / "set"
    link_set(fragment_dir(), out)
    write_q4_1(out)  # raises unless every layer dequantizes to its full fragment bit for bit
    return out


@pytest.mark.needs_model
def test_every_layers_q4_1_fragment_is_its_full_fragment_bit_for_bit(q41_set):
    from engines.gguf_q4_1 import mismatches, q4_1_current
    from trtllm_backend.fragments import read_safetensors
    from trtllm_backend.manifest import Manifest

    m = Manifest(q41_set)
    assert q4_1_current(m)
    for i in (0, m.num_layers - 1):
        q41 = read_safetensors(m.verified_path(m.fragment(i, Precision.Q4_1)))
        full = read_safetensors(m.verified_path(m.fragment(i, Precision.FULL)))
        assert mismatches(q41, full) == []
        assert m.fragment(i, Precision.Q4_1)["bytes"] < m.fragment(i, Precision.FULL)["bytes"] / 6


@pytest.mark.needs_model
def test_the_q4_1_policy_serves_the_full_models_tokens_in_a_sixth_of_the_layer_bytes(q41_set):
    from tests.engine_fixtures import PROMPTS, make_engine, run_greedy

    got = {}
    for policy in ("full", "q4_1"):
        engine = make_engine(
            morph_policy=policy, fragment_dir=str(q41_set), int4_activations="float32", max_batch_size=4
        )
        assert {s.precision for s in engine.model.slots} == {Precision.FULL if policy == "full" else Precision.Q4_1}
        assert engine.morph.int4_layers == 0 and engine.counters.swaps_down == 0  # not a morph: the served form
        got[policy] = (
            run_greedy(engine, PROMPTS[:3], 16)[0],
            engine.morph.account,
            engine.stats().invariant_violations,
        )
        engine.shutdown()
    (full, full_account, _), (q41, q41_account, violations) = got["full"], got["q4_1"]
    assert q41 == full  # fp32 activations: the same weights, another summation order, the same greedy tokens
    assert violations == 0
    assert q41_account.budget == full_account.budget  # equal memory: the bytes the layers free are KV
    assert q41_account.layers < full_account.layers / 6 and q41_account.kv > full_account.kv


@pytest.mark.needs_model
def test_the_q4_1_policy_needs_q4_1_fragments(layer_set):
    from tests.engine_fixtures import make_engine

    from trtllm_backend.errors import FragmentError

    with pytest.raises(FragmentError, match="build_fragments --q4-1"):
        make_engine(morph_policy="q4_1", fragment_dir=str(layer_set))


@pytest.mark.needs_model
@pytest.mark.server
def test_a_q4_1_triton_server_answers_as_the_full_precision_one(q41_set, triton_server, tmp_path):
    """The q4_1 policy through the real tritonserver: the same greedy text as the session's full-precision server
    (fp32 activations: the same weights, another summation order), every layer on Q4_1, no morph."""
    import json

    from tests import ROOT

    from tests.triton_fixtures import TEST_SERVER_PARAMS

    from trtllm_backend.serve import free_ports
    from tests.triton.test_triton_server import http_post, metrics

    from trtllm_backend import serve

    http, grpc, port = free_ports(3)
    params = TEST_SERVER_PARAMS | {"fragment_dir": str(q41_set), "morph_policy": "q4_1", "int4_activations": "float32"}
    handle = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=port,
        params=params,
        backend_dir=ROOT / "build" / "backends",
        build_dir=ROOT / "build",
        log_path=tmp_path / "tritonserver.log",
        ready_timeout=300,
        exit_timeout_s=10,
    )
    try:
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            body = {"text_input": prompt, "max_tokens": 12, "ignore_eos": True}
            answers = [http_post(server, "generate", body) for server in (triton_server, handle)]
            assert [status for status, _ in answers] == [200, 200], answers
            full, q41 = (json.loads(text) for _, text in answers)
            assert q41["text_output"] == full["text_output"] and q41["output_token_count"] == 12
            assert set(q41["int4_layers"]) == {0}  # Q4_1 is the served form, not a morph
        seen = metrics(handle)
        assert seen["morphserve_int4_layers"] == 0
        assert all(v == 0 for k, v in seen.items() if k.startswith("morphserve_layer_swaps_total")), seen
    finally:
        handle.stop(timeout=20)
        handle.clean_shm()
