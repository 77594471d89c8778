"""tools.export_hf: the Hugging Face folder holds exactly the engine's full-precision weights, and reads back."""

import json

import pytest
import torch
from safetensors.torch import load_file

from engines.build_fragments import default_fragment_dir
from engines.hf_import import load_hf
from tools import export_hf
from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision

pytestmark = pytest.mark.needs_model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_hf.export(default_fragment_dir(), tmp_path_factory.mktemp("hf"))


def test_every_tensor_equals_the_engines_bitwise(exported):
    manifest = Manifest(default_fragment_dir())
    state = load_file(exported / "model.safetensors")
    shared = load_file(manifest.verified_path(manifest.data["shared"]))
    expected = {k: v for k, v in shared.items()}
    for i in range(manifest.num_layers):
        layer = load_file(manifest.verified_path(manifest.fragment(i, Precision.FULL)))
        expected.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    assert set(state) == set(expected) and "lm_head.weight" not in state  # tied, as HF leaves it out
    for k, v in expected.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k


def test_the_folder_is_a_plain_llama_that_our_importer_reads_back(exported):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    ckpt = load_hf(exported)
    manifest = Manifest(default_fragment_dir())
    assert ckpt.config == manifest.config
    layer = load_file(manifest.verified_path(manifest.fragment(7, Precision.FULL)))
    assert all(torch.equal(ckpt.layer(7)[k], layer[k]) for k in layer)
    tok = json.loads((exported / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>" and tok["add_bos_token"] is False and tok["chat_template"]
    assert (exported / "tokenizer.json").read_bytes() == manifest.side_file("tokenizer.json").read_bytes()
