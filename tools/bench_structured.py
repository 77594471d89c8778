"""What constrained decoding costs per token at a decode batch, per library, beside the engine's decode step.

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.bench_structured [--batch 16] [--rounds 3]
        [--xgrammar-path DIR] [--out results/structured_outputs/bench.json]

1. Libraries alone (llguidance, outlines-core, and xgrammar when importable; `--xgrammar-path` adds a folder to
   sys.path, for an install kept out of the venv: xgrammar pulls the GPU compiler `triton`): `--batch` matchers
   of one JSON schema walk the tokens of a valid document; each step fills every row's allowed-token mask and
   advances the matchers (`fill_ms`, the library's own share: median per step), and the schema's compile time.
   For llguidance also `step_ms`: the engine's whole masking path (fill, apply to [batch, vocab] logits).
2. The engine, A/B step by step: two twin engines, each with `--batch` requests of the same prompt, one
   unconstrained, one under the schema (the project's llguidance path), stepped in turn, `--rounds` times;
   median decode step time of each, their ratio (of the medians, and the median of the ratios of neighbouring
   steps), and the masking's share of each constrained step measured inside that step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["engineer", "teacher", "doctor"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Elizabeth Bennet",
    "age": 20,
    "role": "teacher",
    "skills": ["reading", "walking", "wit"],
    "address": {"city": "Longbourn", "zip": "12345"},
}
PROMPT = "Describe a character from a novel as JSON with name, age, role, skills and address."


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def bench_llguidance(tok_json: str, vocab: int, eos: list[int], ids: list[int], batch: int) -> dict:
    from trtllm_backend.structured import GrammarCompiler, Guide, MaskBatch

    compiler = GrammarCompiler(tok_json, vocab, eos)
    t = time.perf_counter()
    matchers = [compiler.matcher(Guide("json_schema", json.dumps(SCHEMA))) for _ in range(batch)]
    compile_s = (time.perf_counter() - t) / batch
    masks, logits, steps, fills = MaskBatch(), torch.zeros(batch, vocab), [], []
    bitmask = torch.empty((batch, (vocab + 31) // 32), dtype=torch.int32)
    for tok in ids:
        t = time.perf_counter()
        masks.apply(logits, list(range(batch)), matchers)  # the engine's path: fill, unpack, apply
        for m in matchers:
            assert m.consume_token(tok), m.get_error()
        steps.append(time.perf_counter() - t)
        logits.zero_()
    for m in matchers:
        m.reset()
    for tok in ids:  # the library's own share: masks filled and matchers advanced
        t = time.perf_counter()
        for r, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[r].data_ptr(), bitmask.shape[1] * 4)
        for m in matchers:
            m.consume_token(tok)
        fills.append(time.perf_counter() - t)
    return {"compile_ms": round(compile_s * 1e3, 2), "step_ms": _median_ms(steps), "fill_ms": _median_ms(fills)}


def bench_outlines(vocab_bytes: list[bytes], eos: int, ids: list[int], batch: int) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab_bytes):
        if i != eos and b:
            table.setdefault(b, []).append(i)
    t = time.perf_counter()
    index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA), r"( )?"), oc.Vocabulary(eos, table))
    compile_s = time.perf_counter() - t
    guides = [oc.Guide(index) for _ in range(batch)]
    words = (len(vocab_bytes) + 31) // 32
    bitmask, fills = torch.zeros(batch, words, dtype=torch.int32), []
    for tok in ids[:-1]:  # NOTE: outlines-core's guide ends at the regex's end: it takes no end-of-sequence token
        t = time.perf_counter()
        for r, g in enumerate(guides):
            g.write_mask_into(bitmask[r].data_ptr(), words, 4)
        for g in guides:
            g.advance(tok)
        fills.append(time.perf_counter() - t)
    return {"compile_ms": round(compile_s * 1e3, 2), "fill_ms": _median_ms(fills)}


def bench_xgrammar(vocab_bytes: list[bytes], eos: list[int], ids: list[int], batch: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab_bytes, xgr.VocabType.RAW, vocab_size=len(vocab_bytes), stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, len(vocab_bytes))
    fills = []
    for tok in ids:
        t = time.perf_counter()
        for r, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, r)
        for m in matchers:
            assert m.accept_token(tok)
        fills.append(time.perf_counter() - t)
    return {"compile_ms": round(compile_s * 1e3, 2), "fill_ms": _median_ms(fills)}


def engine_ab(engines: dict, batch: int, rounds: int, max_tokens: int) -> dict:
    """Decode steps of `batch` requests, unconstrained on one engine and under SCHEMA on a twin, stepped in turn
    (which goes first alternates), so both see the same load; and, within each constrained step, the time its
    masking took (fill + apply + advance) as a share of that same step."""
    import trtllm_backend.engine as engine_module
    from trtllm_backend.sampling import SamplingParams
    from trtllm_backend.structured import Guide

    times: dict[str, list[float]] = {k: [] for k in engines}
    paired: list[float] = []
    shares: list[float] = []
    masking = [0.0]
    guided = engines["json_schema"]
    apply, advance = guided._masks.apply, engine_module.advance

    def timed_apply(*a):
        t = time.perf_counter()
        apply(*a)
        masking[0] += time.perf_counter() - t

    def timed_advance(*a):
        t = time.perf_counter()
        advance(*a)
        masking[0] += time.perf_counter() - t

    def step(kind: str) -> float | None:
        """One iteration of `kind`'s engine; its time when it was a decode step of the whole batch."""
        engine = engines[kind]
        decoding = all(r.num_computed == r.num_tokens - 1 for r in engine.scheduler.running)
        full = decoding and len(engine.scheduler.running) == batch
        masking[0] = 0.0
        t = time.perf_counter()
        engine.step()
        took = time.perf_counter() - t
        if not full:
            return None
        times[kind].append(took)
        if kind == "json_schema":
            shares.append(masking[0] / took)
        return took

    guided._masks.apply, engine_module.advance = timed_apply, timed_advance
    try:
        for _ in range(rounds):
            for kind, engine in engines.items():
                guide = Guide("json_schema", json.dumps(SCHEMA)) if kind == "json_schema" else None
                prompt = engine.tokenizer.chat_prompt(PROMPT)
                for i in range(batch):
                    engine.add_request(
                        prompt,
                        SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, guide=guide),
                        lambda o: None,
                    )
            turn = 0
            while True:
                live = []
                for kind, engine in engines.items():
                    engine._drain_inbox()
                    if engine.scheduler.has_work():
                        live.append(kind)
                if not live:
                    break
                took = {kind: step(kind) for kind in (live if turn % 2 == 0 else live[::-1])}
                turn += 1
                if took.get("free") and took.get("json_schema"):
                    paired.append(took["json_schema"] / took["free"])
    finally:
        guided._masks.apply, engine_module.advance = apply, advance
    free, constrained = _median_ms(times["free"]), _median_ms(times["json_schema"])
    return {
        "free_step_ms": free,
        "json_schema_step_ms": constrained,
        "steps": {k: len(v) for k, v in times.items()},
        "step_ratio": round(constrained / free, 4),
        "paired_step_ratio": {"median": round(statistics.median(paired), 4), "pairs": len(paired)},
        "masking_share_of_step": {
            "median": round(statistics.median(shares), 4),
            "p90": round(sorted(shares)[int(0.9 * (len(shares) - 1))], 4),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--xgrammar-path", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.xgrammar_path:
        sys.path.insert(0, str(args.xgrammar_path))
    from engines.build_fragments import default_fragment_dir
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine
    from trtllm_backend.openai.tokens import TokenTexts

    config = EngineConfig(
        fragment_dir=str(default_fragment_dir()),
        morph_policy="full",
        weight_dtype="float16",
        kv_cache_dtype="float16",
        prefill_chunk_tpot_share=0.0,
    )
    engines = {"free": LLMEngine(config), "json_schema": LLMEngine(config)}  # NOTE: twins, stepped in turn
    engine = engines["json_schema"]
    vocab = engine.manifest.config.vocab_size
    eos = sorted(engine.tokenizer.eos_token_ids)
    texts = TokenTexts.from_fragments(engine.config.fragment_dir)
    vocab_bytes = [texts.bytes(i) for i in range(vocab)]
    ids = engine.tokenizer.encode(json.dumps(DOCUMENT, separators=(", ", ": "))) + [eos[0]]
    result = {
        "batch": args.batch,
        "document_tokens": len(ids),
        "libraries": {},
        "load_average_before": list(__import__("os").getloadavg()),
    }
    result["libraries"]["llguidance"] = bench_llguidance(engine.tokenizer.to_json(), vocab, eos, ids, args.batch)
    result["libraries"]["outlines-core"] = bench_outlines(vocab_bytes, eos[0], ids, args.batch)
    try:
        result["libraries"]["xgrammar"] = bench_xgrammar(vocab_bytes, eos, ids, args.batch)
    except ImportError as exc:
        result["libraries"]["xgrammar"] = f"not importable: {exc}"
    print(json.dumps(result["libraries"], indent=1), flush=True)
    result["engine"] = engine_ab(engines, args.batch, args.rounds, args.max_tokens)
    words = list(argv if argv is not None else sys.argv[1:])
    if args.xgrammar_path:  # NOTE: the folder is this machine's; the record names only its role
        words = ["DIR" if w == str(args.xgrammar_path) else w for w in words]
    result["command"] = "python -m tools.bench_structured " + " ".join(words)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
