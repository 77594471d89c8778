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
