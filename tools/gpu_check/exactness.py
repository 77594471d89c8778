"""Exactness: the engine on the device against the CPU reference (reference.py) on the tiny shape, with every layer
at full precision and then every layer INT4.

Prompts of several lengths run together (chunked prefill, a mixed step, then batched decode over several KV blocks),
greedy, end-of-sequence ignored. Each prompt is drawn (seeded) until both references' greedy runs from it are decisive
(top-2 logit gap >= MIN_GAP at every token), so rounding within the tolerance cannot flip a token. Per precision: the engine's logits of every sampled row against the reference's on
the same tokens (max |difference| over the largest |reference logit|, within TOLERANCE), and the engine's greedy
tokens against the reference's own greedy run (equal).
"""

from __future__ import annotations

import torch

from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams

from .harness import Outputs, close, make_engine, placement, placement_ok
from .reference import Reference
from .synth import prompt

PROMPT_LENGTHS = (5, 17, 33, 50)
MAX_TOKENS = 12
MIN_GAP = 0.15  # ~10x the logit error fp16 is expected to make at this shape (logits up to ~15)
MAX_DRAWS = 32  # candidates per prompt length, run as one batch
CHUNK_TOKENS = 48  # max_num_tokens: the 50-token prompt is prefilled in two chunks
# max |engine - reference| / max |reference| over every compared logit. fp32 compute differs from the reference by
# summation order only; fp16 / bf16 by rounding (fp16 weights, activations and K/V; INT4 kernels take bf16 activations).
TOLERANCE = {
    (Precision.FULL, torch.float32): 1e-4,
    (Precision.FULL, torch.float16): 1e-2,
    (Precision.FULL, torch.bfloat16): 3e-2,
    (Precision.INT4, torch.float32): 3e-2,
    (Precision.INT4, torch.float16): 3e-2,
    (Precision.INT4, torch.bfloat16): 5e-2,
}


def _engine_run(fragment_dir, device: str, threads, policy: str, prompts: list[list[int]]):
    engine, load_s = make_engine(
        fragment_dir,
        device,
        threads,
        morph_policy=policy,
        max_batch_size=len(prompts),
        max_num_tokens=CHUNK_TOKENS,
        max_tokens_in_paged_kv_cache=1024,
        prefill_chunk_tpot_share=0.0,
        int4_activations="float32",
    )
    try:
        info = {
            "load_s": round(load_s, 2),
            "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
            "kv_dtype": str(engine.config.kv_torch_dtype).removeprefix("torch."),
            "int4_layers": engine.stats().int4_layers,
            "placement": placement(engine),
        }
        rows: dict[str, list[torch.Tensor]] = {}
        engine.on_logits = lambda rid, row: rows.setdefault(rid, []).append(row.detach().float().cpu())
        outs = Outputs()
        for i, ids in enumerate(prompts):
            rid = f"p{i}"
            engine.add_request(
                prompt(ids), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), outs.callback(rid), request_id=rid
            )
        try:
            engine.run_until_idle()
            if outs.errors():
                raise RuntimeError(f"requests failed: {outs.errors()}")
        except Exception as e:  # where the tensors were says most about a device mismatch
            raise RuntimeError(f"{policy} engine: {type(e).__name__}: {e} [placement: {info['placement']}]") from e
        info["invariant_violations"] = engine.stats().invariant_violations
        eos = sorted(engine.tokenizer.eos_token_ids)
        return info, outs.tokens, rows, eos
    finally:
        close(engine, device)


def compare(
    ref: Reference,
    prompts: list[list[int]],
    tokens: dict,
    rows: dict,
    eos: list[int],
    dtype: torch.dtype,
    precision: str,
) -> dict:
    worst, scale, min_gap, per_request = 0.0, 0.0, float("inf"), []
    equal = True
    for i, ids in enumerate(prompts):
        got, rid = tokens[f"p{i}"], f"p{i}"
        seq = ids + got[:-1]
        want = ref.logits(seq)[len(ids) - 1 :]  # the rows that sampled each engine token, on the engine's tokens
        mine = torch.stack(rows[rid])
        keep = torch.ones(want.shape[1], dtype=torch.bool)
        keep[eos] = False  # masked to -inf by the engine (ignore_eos)
        diff = float((mine[:, keep] - want[:, keep]).abs().max())
        top2 = want[:, keep].topk(2, dim=1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        greedy = ref.greedy(torch.tensor([ids]), len(got), eos)[0][0].tolist()
        same = greedy == got
        first = next((k for k, (a, b) in enumerate(zip(got, greedy)) if a != b), None)
        per_request.append(
            {
                "prompt_tokens": len(ids),
                "max_abs_diff": diff,
                "tokens_equal": same,
                "first_divergence": first,
                "engine_tokens": got,
                "reference_tokens": greedy,
            }
        )
        worst, scale, min_gap, equal = (
            max(worst, diff),
            max(scale, float(want[:, keep].abs().max())),
            min(min_gap, gap),
            equal and same,
        )
    tol = TOLERANCE[(precision, dtype)]
    rel = worst / scale
    return {
        "max_abs_diff": worst,
        "max_abs_reference_logit": scale,
        "relative_diff": rel,
        "tolerance": tol,
        "within_tolerance": rel <= tol,
        "tokens_equal": equal,
        "min_reference_top2_gap": min_gap,
        "requests": per_request,
    }


def decisive_prompt(
    refs: list[Reference], length: int, gen: torch.Generator, eos: list[int]
) -> tuple[list[int], float, int]:
    """A prompt of `length` tokens from which every reference's greedy run keeps its top-2 gap >= MIN_GAP (else the
    most decisive of MAX_DRAWS), with its smallest gap and the draws it took. Candidates run as one batch."""
    ids = torch.randint(2, refs[0].config.vocab_size, (MAX_DRAWS, length), generator=gen)
    gaps = torch.stack([r.greedy(ids, MAX_TOKENS, eos)[1].min(1).values for r in refs]).min(0).values
    decisive = (gaps >= MIN_GAP).nonzero().flatten()
    pick = int(decisive[0]) if len(decisive) else int(gaps.argmax())
    return ids[pick].tolist(), float(gaps[pick]), pick + 1


def run(fragment_dir, device: str, threads: int | None = None, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    refs = {p: Reference(fragment_dir, p) for p in (Precision.FULL, Precision.INT4)}
    eos = [refs[Precision.FULL].config.eos_token_id]
    drawn = [decisive_prompt(list(refs.values()), n, gen, eos) for n in PROMPT_LENGTHS]
    prompts = [ids for ids, _, _ in drawn]
    out = {
        "prompt_lengths": list(PROMPT_LENGTHS),
        "max_tokens": MAX_TOKENS,
        "max_num_tokens": CHUNK_TOKENS,
        "min_gap_wanted": MIN_GAP,
        "prompt_min_gaps": [g for _, g, _ in drawn],
        "prompt_draws": [d for _, _, d in drawn],
        "reference": "fp32 on the CPU, plain torch from the fragment files (tools/gpu_check/reference.py)",
        "tolerance_means": "max |engine - reference| logit / max |reference| logit, end-of-sequence ids excluded",
    }
    ok = True
    for precision, policy in ((Precision.FULL, "full"), (Precision.INT4, "int4")):
        info, tokens, rows, eos = _engine_run(fragment_dir, device, threads, policy, prompts)
        res = compare(refs[precision], prompts, tokens, rows, eos, getattr(torch, info["dtype"]), precision)
        res["engine"] = info
        res["placement_ok"] = placement_ok(info["placement"], device)
        want_int4 = refs[precision].config.num_layers if precision == Precision.INT4 else 0
        res["ok"] = (
            res["within_tolerance"]
            and res["tokens_equal"]
            and res["placement_ok"]
            and info["int4_layers"] == want_int4
            and info["invariant_violations"] == 0
        )
        out[precision] = res
        ok = ok and res["ok"]
    out["ok"] = ok
    return out
