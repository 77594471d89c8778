"""AWQ/INT8 fragment building: fast unit tests of the folding math, and checks on the real fragment set.

The real-set tests build what they need (full fragments, then ModelOpt calibration) when `make setup` has
not already done it, so they never skip in CI.
"""

import importlib
import subprocess

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engines import quantize_awq as qa
from plugins.quant_matmul import GROUP_SIZE, dequantize_int4, load_quantized_layer, quantized_layer_nbytes
from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision

torch.manual_seed(0)
HID, INTER, NH, NKV, HD, EPS = 576, 1536, 9, 3, 64, 1e-5


def cosine(a, b):  # float64: SmolLM2's massive activations make a fp32 cosine over 3e5 values exceed 1
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def dense_layer(full: dict) -> dict:
    cat = lambda *names: torch.cat([full[n + ".weight"] for n in names])
    ws = {
        "qkv": cat("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "o": cat("self_attn.o_proj"),
        "gate_up": cat("mlp.gate_proj", "mlp.up_proj"),
        "down": cat("mlp.down_proj"),
    }
    layer = {k: (lambda x, w=w: x @ w.t()) for k, w in ws.items()}
    layer.update({n: full[n + ".weight"] for n in ("input_layernorm", "post_attention_layernorm")})
    return layer


def layer_forward(layer: dict, h: torch.Tensor, theta: float = 1e5) -> torch.Tensor:
    """One Llama decoder layer on h [T, hidden] (HF half-split RoPE, causal GQA), using the runtime's dict."""
    T = h.shape[0]
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    qkv = layer["qkv"](F.rms_norm(h, (HID,), layer["input_layernorm"], EPS))
    q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD], -1)
    q, k, v = rope(q.view(T, NH, HD)), rope(k.view(T, NKV, HD)), v.view(T, NKV, HD)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    h = h + layer["o"](attn.transpose(0, 1).reshape(T, NH * HD))
    gate, up = layer["gate_up"](F.rms_norm(h, (HID,), layer["post_attention_layernorm"], EPS)).chunk(2, -1)
    return h + layer["down"](F.silu(gate) * up)


def random_full_layer() -> dict:
    shapes = {
        "self_attn.q_proj": (NH * HD, HID),
        "self_attn.k_proj": (NKV * HD, HID),
        "self_attn.v_proj": (NKV * HD, HID),
        "self_attn.o_proj": (HID, NH * HD),
        "mlp.gate_proj": (INTER, HID),
        "mlp.up_proj": (INTER, HID),
        "mlp.down_proj": (HID, INTER),
    }
    full = {k + ".weight": torch.randn(s) * 0.05 for k, s in shapes.items()}
    full.update({n + ".weight": 1 + 0.1 * torch.randn(HID) for n in ("input_layernorm", "post_attention_layernorm")})
    return full


# ---------------------------------------------------------------- fast: the folding math on a random layer


def test_int4_fragment_folds_scales_without_changing_the_function():
    full = random_full_layer()
    scales = {n: torch.rand(INTER if n == "down" else HID) + 0.5 for n in ("qkv", "o", "gate_up", "down")}
    frag = qa.int4_fragment(full, scales, 32)
    assert "qkv.pre_scale" not in frag and "gate_up.pre_scale" not in frag  # folded into the norms
    torch.testing.assert_close(frag["input_layernorm.weight"], full["input_layernorm.weight"] * scales["qkv"])
    torch.testing.assert_close(frag["down.pre_scale"], scales["down"])
    # Unfolded reference: the dequantized grid times the folded scales, with the original norms.
    unfolded = {
        n: dequantize_int4(frag, n + ".") * scales[n] if n in ("qkv", "gate_up") else dequantize_int4(frag, n + ".")
        for n in ("qkv", "o", "gate_up", "down")
    }
    ref_q = {n: (lambda x, w=w: x @ w.t()) for n, w in unfolded.items()}
    ref_q.update({n: full[n + ".weight"] for n in ("input_layernorm", "post_attention_layernorm")})
    h = torch.randn(16, HID)
    out = layer_forward(load_quantized_layer(frag, {"group_size": 32}), h)
    assert cosine(out - h, layer_forward(ref_q, h) - h) > 0.999  # only the bf16 activations differ
    assert cosine(out - h, layer_forward(dense_layer(full), h) - h) > 0.9  # int4 noise on random weights


def test_int8_fragment_and_layer_bytes():
    full = random_full_layer()
    layer = load_quantized_layer(qa.int8_fragment(full), {})
    h = torch.randn(16, HID)
    assert cosine(layer_forward(layer, h) - h, layer_forward(dense_layer(full), h) - h) > 0.999
    full_bytes = sum(t.numel() * 4 for t in full.values())
    assert 0.25 < quantized_layer_nbytes(layer) / full_bytes < 0.26


def test_group_size_mismatch_is_refused():
    frag = qa.int4_fragment(
        random_full_layer(), {n: torch.ones(INTER if n == "down" else HID) for n in ("qkv", "o", "gate_up", "down")}, 32
    )
    with pytest.raises(ValueError, match="group size"):
        load_quantized_layer(frag, {"group_size": 64})


def test_calibration_text_stays_in_the_first_80_percent(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "calib": 1, "heldout": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = tmp_path / "c.txt"
    corpus.write_text("calib " * 4000 + "heldout " * 750)  # "heldout" fills the last 20%
    s = qa.calibration_samples(tok, corpus, 8, 16)
    assert s.shape == (8, 16) and (s == 1).all()


# ---------------------------------------------------------------- real fragment set (built when missing)


@pytest.fixture(scope="module")
def real_set():
    from engines import build_fragments

    out = build_fragments.default_fragment_dir()
    build_fragments.main(["--if-missing", "--no-lm-head"])  # the layers only: the head is not this test's
    if not qa.fragments_current(Manifest(out), [Precision.INT4, Precision.INT8], GROUP_SIZE):  # `make setup` not run
        subprocess.run(["bash", str(qa.REPO_ROOT / "tools" / "setup_calib.sh")], check=True)  # ModelOpt
        importlib.invalidate_caches()
        assert qa.main([]) == 0  # several minutes: ModelOpt calibration on 2 cores
    return Manifest(out)


@pytest.mark.needs_model
def test_manifest_lists_verified_quantized_fragments(real_set):
    m = real_set
    for i in range(m.num_layers):
        e4, e8 = m.fragment(i, Precision.INT4), m.fragment(i, Precision.INT8)
        assert e4["group_size"] == GROUP_SIZE and e4["method"] == "awq-modelopt" and e4["format"] == "safetensors"
        assert m.verified_path(e4) and m.verified_path(e8)  # size and sha256
        assert e4["bytes"] < 0.17 * m.fragment(i, Precision.FULL)["bytes"] < e8["bytes"]
    rec = m.data["quantization"][Precision.INT4]
    assert rec["samples"] > 0 and rec["seq_len"] > 0 and rec["corpus_range"] == [0.0, 0.8]
    assert qa.fragments_current(m, [Precision.INT4, Precision.INT8], GROUP_SIZE)


@pytest.mark.needs_model
def test_int4_layers_track_the_full_layers_on_real_hidden_states(real_set):
    m = real_set
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(m.side_file(m.data["tokenizer"]["file"])))
    text = (qa.REPO_ROOT / qa.DEFAULT_CORPUS).read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode(text[int(len(text) * 0.92) :][:2000]).ids[:128])  # held-out text
    shared = load_file(m.verified_path(m.data["shared"]))
    h = shared["model.embed_tokens.weight"][ids]
    with torch.no_grad():
        for i in range(m.num_layers):
            full = dense_layer(load_file(m.verified_path(m.fragment(i, Precision.FULL))))
            layer = load_quantized_layer(
                load_file(m.verified_path(m.fragment(i, Precision.INT4))), m.fragment(i, Precision.INT4)
            )
            ref, out = layer_forward(full, h), layer_forward(layer, h)
            assert cosine(out, ref) > 0.99, f"layer {i}"
            assert cosine(out - h, ref - h) > 0.98, f"layer {i} (its own contribution)"  # measured >= 0.99
            h = ref


@pytest.mark.needs_model
def test_hf_export_comes_from_the_same_calibration(real_set):
    import json

    from safetensors import safe_open

    hf_dir = real_set.dir.parent / "hf_w4a16_awq"
    quant = json.loads((hf_dir / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_AWQ" and quant["group_size"] == GROUP_SIZE
    exported = safe_open(str(hf_dir / "model.safetensors"), "pt")
    for i in (0, real_set.num_layers - 1):
        frag = load_file(real_set.verified_path(real_set.fragment(i, Precision.INT4)))
        p = f"model.layers.{i}."
        # ModelOpt's export folds the same mean q|k|v scale into the norm and keeps o_proj's pre-quant scale.
        torch.testing.assert_close(exported.get_tensor(p + "input_layernorm.weight"), frag["input_layernorm.weight"])
        torch.testing.assert_close(exported.get_tensor(p + "self_attn.o_proj.pre_quant_scale"), frag["o.pre_scale"])
