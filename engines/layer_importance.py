"""Layer importance scores (MorphServe LIS) and the greedy swap order.

    LIS_p = 0.25 * LTS_p + 0.25 * LRS_p + 0.5 * MDS_p(Q)

all cosine similarities (higher = the layer matters less, so it is swapped first):
LTS: the layer's input vs its output (a layer that changes little is cheap to perturb);
LRS: the full layer's output vs the INT4 layer's output on the same input;
MDS: final hidden states with the current quantized set Q vs Q + {p} (state-aware, recomputed each round).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from trtllm_backend.precision import Precision

from .offline_model import OfflineModel


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten(1), b.flatten(1), dim=-1).mean())


@torch.inference_mode()
def static_scores(m: OfflineModel, ids: torch.Tensor) -> tuple[list[float], list[float]]:
    """LTS and LRS of every layer at full precision."""
    m.set_quantized([])
    states, plan, rope = m.layer_inputs(ids)
    lts, lrs = [], []
    for i, slot in enumerate(m.model.slots):
        x, y = states[i], states[i + 1]
        lts.append(_cos(x, y))
        slot.bind(m.int4[i], Precision.INT4)
        y_q = slot.forward(x, *rope, plan)
        slot.bind(m.full[i], Precision.FULL)
        lrs.append(_cos(y, y_q))
    return lts, lrs


@torch.inference_mode()
def greedy_order(m: OfflineModel, ids: torch.Tensor, rounds: int | None = None) -> tuple[list[int], list[dict]]:
    """Pick layers one by one, highest LIS first, with MDS measured against the set picked so far."""
    n = m.config.num_layers
    lts, lrs = static_scores(m, ids)
    chosen: list[int] = []
    log: list[dict] = []
    rounds = n if rounds is None else rounds
    bar = tqdm(total=rounds * (2 * n - rounds + 1) // 2, desc="LIS profiling", unit="fwd")
    for _ in range(rounds):
        m.set_quantized(chosen)
        states, plan, rope = m.layer_inputs(ids)
        ref = states[-1]
        best, best_score, scores = None, -2.0, {}
        for p in range(n):
            if p in chosen:
                continue
            m.model.slots[p].bind(m.int4[p], Precision.INT4)
            out = m.run_layers(states[p], p, plan, rope)  # layers before p are unchanged: start at p
            m.model.slots[p].bind(m.full[p], Precision.FULL)
            mds = _cos(ref, out)
            lis = 0.25 * lts[p] + 0.25 * lrs[p] + 0.5 * mds
            scores[p] = {"lts": lts[p], "lrs": lrs[p], "mds": mds, "lis": lis}
            if lis > best_score:
                best, best_score = p, lis
            bar.update(1)
        chosen.append(best)
        log.append({"picked": best, **scores[best]})
    bar.close()
    m.set_quantized([])
    return chosen, log


# ---- the tied embedding / LM head as one unit of the same order ------------------------------------------
#
# The head's INT8 fragment is scored with the same formula, term by term where a term has a meaning for it:
#   LRS_head: the full head's logits vs the INT8 head's logits on the same final hidden states (its own
#             output error, as LRS is a layer's);
#   MDS_head: final hidden states with Q vs Q + {head} (the INT8 embedding's effect downstream, as MDS is a
#             layer's; the head's own error is in LRS since the final hidden states do not see it).
#   LTS has no counterpart (the table maps token ids to hidden states and hidden states to logits: there is no
#   input and output in one space to compare), so the head is scored on the other two with their weights
#   renormalized: LIS_head = (0.25 * LRS + 0.5 * MDS) / 0.75.
# Its rank is where the greedy would pick it: the first round whose picked layer scored no higher than the head
# (scored against that round's quantized set). The layers' later rounds were profiled without the head
# quantized; re-profiling them with it is a second-order change that is not made.


@torch.inference_mode()
def head_scores(m: OfflineModel, ids: torch.Tensor, quantized: list[int]) -> dict:
    m.set_quantized(quantized)
    m.set_head(False)
    states, _, _ = m.layer_inputs(ids)
    ref = states[-1]
    ref_logits = m.logits(ref)
    m.set_head(True)
    lrs = _cos(ref_logits, m.logits(ref))
    mds = _cos(ref, m.layer_inputs(ids)[0][-1])
    m.set_head(False)
    m.set_quantized([])
    return {"lrs": lrs, "mds": mds, "lis": (0.25 * lrs + 0.5 * mds) / 0.75}


def head_rank(m: OfflineModel, ids: torch.Tensor, order: list[int], rounds: list[dict]) -> tuple[int, dict]:
    """(rank, the head's scores at that round): the head goes before order[rank]. `rounds`: the greedy's log
    of the profiled layer order (greedy_order's second result, as the manifest's swap_order_profile keeps it)."""
    if len(rounds) != len(order):
        raise ValueError(f"the profile has {len(rounds)} rounds for {len(order)} layers in the swap order")
    for k in range(len(order) + 1):
        scores = head_scores(m, ids, order[:k])
        if k == len(order) or scores["lis"] >= rounds[k]["lis"]:
            return k, scores
    raise AssertionError("unreachable")
