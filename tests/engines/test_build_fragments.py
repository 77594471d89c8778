"""Model import: RoPE layout normalisation, HF checkpoints, manifest integrity."""

import json
import shutil

import pytest
import torch
from tests.engine_fixtures import fragment_dir
from safetensors.torch import save_file

from engines.build_fragments import build, fragments_ok
from engines.gguf_import import interleaved_to_half_split
from engines.hf_import import load_hf
from trtllm_backend.fragments import FragmentStore, read_safetensors
from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF Q/K rows (half-split -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_rope_layout_normalisation_inverts_llama_cpp():
    w = torch.randn(9 * 64, 576)
    assert torch.equal(interleaved_to_half_split(llama_cpp_permute(w, 9), 9), w)


@pytest.mark.needs_model
def test_hf_checkpoint_imports_to_the_same_fragments(tmp_path):
    src = Manifest(fragment_dir())
    layers = 2
    cfg = src.config
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "rms_norm_eps": cfg.rms_norm_eps,
                "rope_theta": cfg.rope_theta,
                "vocab_size": cfg.vocab_size,
                "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": True,
                "bos_token_id": cfg.bos_token_id,
                "eos_token_id": cfg.eos_token_id,
            }
        )
    )
    tensors = dict(read_safetensors(src.verified_path(src.data["shared"])))
    for i in range(layers):
        for name, t in read_safetensors(src.verified_path(src.fragment(i, Precision.FULL))).items():
            tensors[f"model.layers.{i}.{name}"] = t
    save_file(tensors, hf / "model.safetensors")
    shutil.copy(src.dir / "tokenizer.json", hf / "tokenizer.json")
    out = tmp_path / "fragments"
    build(load_hf(hf), out, "tiny")
    assert fragments_ok(out)
    m = Manifest(out)
    assert m.num_layers == layers and m.data["source"]["format"] == "hf-safetensors"
    for i in range(layers):
        a = read_safetensors(m.verified_path(m.fragment(i, Precision.FULL)))
        b = read_safetensors(src.verified_path(src.fragment(i, Precision.FULL)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A modified file no longer verifies.
    f = out / m.fragment(1, Precision.FULL)["file"]
    data = bytearray(f.read_bytes())
    data[-8] ^= 1
    f.write_bytes(data)
    assert not fragments_ok(out)


@pytest.mark.needs_model
def test_read_safetensors_matches_the_reference_loader():
    from safetensors.torch import load_file

    m = Manifest(fragment_dir())
    path = m.verified_path(m.fragment(0, Precision.FULL))
    ours, ref = read_safetensors(path), load_file(path)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    store = FragmentStore(m, torch.float32)
    assert store.load_layer(0).nbytes == sum(t.numel() * 4 for t in ours.values())
