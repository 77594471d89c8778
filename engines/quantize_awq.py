"""INT4 (AWQ, calibrated with NVIDIA ModelOpt) and INT8 fragments for every decoder layer.

    python -m engines.quantize_awq            # cached: does nothing when the manifest entries verify
    python -m engines.quantize_awq --force --samples 32 --seq-len 256 --hf-export DIR

Pipeline: full-precision fragments -> transformers LlamaForCausalLM -> ModelOpt INT4_AWQ (awq_lite, block
size = GROUP_SIZE) on text from the first 80% of the corpus (the last 10% is held out for perplexity) ->
per-layer AWQ pre-quant scales -> `layer_XXX.int4.safetensors` (+ `layer_XXX.int8.safetensors`, plain
per-channel RTN) listed in manifest.json -> ModelOpt's unified HF checkpoint (W4A16_AWQ) for TensorRT-LLM.
ModelOpt is imported only for calibration (install it with tools/setup_calib.sh).

These INT4 fragments are the morph rung: they stand in for the INT4 form of an FP16 model (a re-quantization, +6.7%
perplexity with every layer INT4). A GGUF's own Q4_1 blocks are served as they are, losslessly, by another
precision (engines/gguf_q4_1.py, morph_policy=q4_1).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from plugins.quant_matmul import GROUP_SIZE, quantize_int4, quantize_int8
from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import Manifest, file_entry, write_manifest
from trtllm_backend.precision import Precision

from .build_fragments import REPO_ROOT, default_fragment_dir, layer_file

METHOD = "awq-modelopt"
DEFAULT_CORPUS = "../shared/data/corpus/austen_novels.txt"
CALIB_FRACTION = 0.8  # calibration text comes from the first 80%; the last 10% is held-out perplexity text

# (fused name, HF projections sharing one input, the RMSNorm producing that input or None)
GROUPS = (
    ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    ("o", ("self_attn.o_proj",), None),
    ("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    ("down", ("mlp.down_proj",), None),
)


# ---------------------------------------------------------------- the reference model and calibration text


def build_hf_model(manifest: Manifest):
    """transformers LlamaForCausalLM (fp32, HF half-split RoPE) holding the full-precision fragments."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = manifest.config
    config = LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        architectures=["LlamaForCausalLM"],  # ModelOpt's HF export needs it
        dtype="float32",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = dict(load_file(manifest.verified_path(manifest.data["shared"])))
    for i in range(c.num_layers):
        tensors = load_file(manifest.verified_path(manifest.fragment(i, Precision.FULL)))
        state.update({f"model.layers.{i}.{k}": v for k, v in tensors.items()})
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # buffers were on meta
    return model.eval()


def calibration_samples(tokenizer: Tokenizer, corpus: Path, n: int, seq_len: int) -> torch.Tensor:
    """n windows of seq_len tokens, spread evenly over the first CALIB_FRACTION of the corpus. [n, seq_len]"""
    text = corpus.read_text(encoding="utf-8")
    end = int(len(text) * CALIB_FRACTION)
    span = seq_len * 12  # characters; generously more than seq_len tokens of prose
    rows = []
    for start in torch.linspace(0, end - span, n).long().tolist():
        ids = tokenizer.encode(text[start : start + span]).ids[1 : seq_len + 1]  # drop a possibly cut first word
        if len(ids) < seq_len:
            raise ValueError(f"corpus window at {start} gives {len(ids)} < {seq_len} tokens")
        rows.append(ids)
    return torch.tensor(rows)


def calibrate(model, samples: torch.Tensor, group_size: int, batch: int = 16) -> None:
    """ModelOpt INT4 AWQ (awq_lite) in place: sets `input_quantizer._pre_quant_scale` on every linear."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {-1: group_size, "type": "static"}

    def forward_loop(m):  # ModelOpt calls it twice: statistics, then the scale search (~10x slower)
        batches, layers = samples.split(batch), m.model.layers
        with tqdm(total=len(batches) * len(layers), desc="AWQ calibration pass", unit="layer") as bar:

            def tick(*_):  # NOTE: must return None: a forward hook's return value replaces the layer output
                bar.update()

            hooks = [layer.register_forward_hook(tick) for layer in layers]
            try:
                for chunk in batches:
                    m.model(chunk, use_cache=False)  # decoder only: the unquantized LM head is 1/3 of the FLOPs
            finally:
                for h in hooks:
                    h.remove()

    with torch.no_grad():
        mtq.quantize(model, cfg, forward_loop)


def pre_quant_scales(model, index: int) -> dict[str, torch.Tensor]:
    """AWQ scales of one layer, one per fused group: mean over the group, as ModelOpt's export resmooths."""
    layer = model.model.layers[index]

    def scale(proj: str) -> torch.Tensor:
        linear = layer.get_submodule(proj)
        s = getattr(linear.input_quantizer, "_pre_quant_scale", None)
        return torch.ones(linear.in_features) if s is None else s.detach().float().flatten()

    return {name: torch.stack([scale(p) for p in projs]).mean(0) for name, projs, _ in GROUPS}


# ---------------------------------------------------------------- fragments


def int4_fragment(full: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], group_size: int) -> dict:
    """Full tensors + AWQ scales -> INT4 fragment tensors. Scales of q|k|v and gate|up fold into the RMSNorm
    that feeds them (norm_w * s, exact); o and down keep theirs as `pre_scale` on the activations."""
    out = {}
    for name, projs, norm in GROUPS:
        out.update(
            quantize_int4(torch.cat([full[p + ".weight"] for p in projs]), group_size, scales[name], prefix=name + ".")
        )
        if norm is not None:
            out[norm + ".weight"] = full[norm + ".weight"] * out.pop(name + ".pre_scale")
    return out


def int8_fragment(full: dict[str, torch.Tensor]) -> dict:
    out = {n + ".weight": full[n + ".weight"] for _, _, n in GROUPS if n}
    for name, projs, _ in GROUPS:
        out.update(quantize_int8(torch.cat([full[p + ".weight"] for p in projs]), prefix=name + "."))
    return out


def fragments_current(manifest: Manifest, precisions: list[str], group_size: int) -> bool:
    """True when every layer lists every wanted precision, built with this group size, and the file verifies."""
    try:
        for i in range(manifest.num_layers):
            for p in precisions:
                entry = manifest.fragment(i, p)
                if p == Precision.INT4 and (entry.get("group_size") != group_size or entry.get("method") != METHOD):
                    return False
                manifest.verified_path(entry)
        return True
    except (FragmentError, KeyError, IndexError):
        return False


def write_fragments(manifest: Manifest, model, precisions: list[str], group_size: int, record: dict) -> dict:
    """Write one file per layer and precision, then add them to manifest.json (re-read first: others write it)."""
    entries = []
    for i in tqdm(range(manifest.num_layers), desc="quantized fragments", unit="layer"):
        full = load_file(manifest.verified_path(manifest.fragment(i, Precision.FULL)))
        made = {}
        if Precision.INT4 in precisions:
            made[Precision.INT4] = (
                int4_fragment(full, pre_quant_scales(model, i), group_size),
                {"group_size": group_size, "method": METHOD},
            )
        if Precision.INT8 in precisions:
            made[Precision.INT8] = (int8_fragment(full), {"method": "rtn-per-channel"})
        layer = {}
        for p, (tensors, extra) in made.items():
            path = manifest.dir / layer_file(i, p)
            save_file(
                tensors,
                path,
                metadata={"format": "pt", "layer": str(i), "precision": p, **{k: str(v) for k, v in extra.items()}},
            )
            layer[p] = file_entry(path, **extra, format="safetensors")
        entries.append(layer)
    data = Manifest(manifest.dir).data
    for i, layer in enumerate(entries):
        data["layers"][i]["fragments"].update(layer)
    data.setdefault("quantization", {})[Precision.INT4] = record  # calibration provenance
    write_manifest(manifest.dir, data)
    return data


def export_hf(model, export_dir: Path) -> None:
    """ModelOpt's unified HF checkpoint (W4A16_AWQ): input for TensorRT-LLM engine builds on a GPU.
    NOTE: mutates the model (resmooths fused groups, folds scales into norms): call it last."""
    from modelopt.torch.export import export_hf_checkpoint

    export_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=str(export_dir))


# ---------------------------------------------------------------- command line


def _repo_path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fragments", help="fragment directory (default: model_repository/smollm2/1/fragments)")
    ap.add_argument("--corpus", default=DEFAULT_CORPUS, help="calibration text (relative to the repo root)")
    # NOTE: 16x128 tokens, not 32x256: awq_lite's search pass costs ~90 ms/token on 2 cores (4 min here);
    # the scales hardly move with more text (o_proj's range: 0.5399-1.8522 at 512 tokens, 0.5398-1.8526 at 2048).
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE)
    ap.add_argument("--no-int8", action="store_true", help="skip the INT8 middle rung")
    ap.add_argument("--hf-export", help="unified HF checkpoint dir (default: <fragments>/../hf_w4a16_awq)")
    ap.add_argument("--no-hf-export", action="store_true")
    ap.add_argument("--force", action="store_true", help="rebuild even when the manifest entries verify")
    args = ap.parse_args(argv)

    frag_dir = _repo_path(args.fragments) if args.fragments else default_fragment_dir()
    manifest = Manifest(frag_dir)
    precisions = [Precision.INT4] + ([] if args.no_int8 else [Precision.INT8])
    hf_dir = _repo_path(args.hf_export) if args.hf_export else frag_dir.parent / "hf_w4a16_awq"
    export_ok = args.no_hf_export or (hf_dir / "hf_quant_config.json").is_file()
    if not args.force and export_ok and fragments_current(manifest, precisions, args.group_size):
        print(f"[quantize] up to date: {', '.join(precisions)} fragments in {frag_dir}")
        return 0

    t0 = time.perf_counter()
    model = build_hf_model(manifest)
    tokenizer = Tokenizer.from_file(str(manifest.side_file(manifest.data["tokenizer"]["file"])))
    corpus = _repo_path(args.corpus)
    samples = calibration_samples(tokenizer, corpus, args.samples, args.seq_len)
    t1 = time.perf_counter()
    print(
        f"[quantize] model + {args.samples}x{args.seq_len} calibration tokens ready in {t1 - t0:.1f}s; "
        f"ModelOpt INT4_AWQ (awq_lite), group size {args.group_size}, {torch.get_num_threads()} threads"
    )
    calibrate(model, samples, args.group_size)
    t2 = time.perf_counter()
    print(f"[quantize] calibration took {t2 - t1:.1f}s")
    record = {
        "method": METHOD,
        "group_size": args.group_size,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "corpus": corpus.name,
        "corpus_range": [0.0, CALIB_FRACTION],
        "calibration_s": round(t2 - t1, 1),
    }
    write_fragments(manifest, model, precisions, args.group_size, record)
    t3 = time.perf_counter()
    print(f"[quantize] fragments written in {t3 - t2:.1f}s")
    if not args.no_hf_export:
        export_hf(model, hf_dir)
        print(f"[quantize] HF W4A16_AWQ checkpoint in {hf_dir} ({time.perf_counter() - t3:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
