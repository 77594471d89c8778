"""engines.layer_importance on tiny fake models: LIS = 0.25*LTS + 0.25*LRS + 0.5*MDS(Q) checked against cosines
worked out by hand, and the greedy order (MDS measured against the set picked so far) against a from-scratch
reference on a model whose layers do not commute."""

import math
from types import SimpleNamespace

import pytest
import torch

from engines.layer_importance import greedy_order, static_scores
from trtllm_backend.precision import Precision


class Slot:
    def __init__(self, fn):
        self.fn, self.precision = fn, Precision.FULL

    def bind(self, fn, precision):
        self.fn, self.precision = fn, precision

    def forward(self, h, cos, sin, plan):
        return self.fn(h)


class FakeModel:
    """What layer_importance uses of OfflineModel, over plain functions of the hidden state [tokens, dim]."""

    def __init__(self, full, int4, h0):
        self.full, self.int4, self.h0 = full, int4, h0
        self.config = SimpleNamespace(num_layers=len(full))
        self.model = SimpleNamespace(slots=[Slot(f) for f in full])

    def set_quantized(self, layers):
        for i, slot in enumerate(self.model.slots):
            slot.bind(self.int4[i] if i in layers else self.full[i], Precision.INT4 if i in layers else Precision.FULL)

    def layer_inputs(self, ids):
        h = self.h0.expand(ids.numel(), -1)
        states = [h]
        for slot in self.model.slots:
            states.append(slot.forward(states[-1], None, None, None))
        return states, None, (None, None)

    def run_layers(self, h, start, plan, rope):
        for slot in self.model.slots[start:]:
            h = slot.forward(h, None, None, None)
        return h


def rotation(deg: float):
    a = math.radians(deg)
    r = torch.tensor([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]], dtype=torch.float64)
    return lambda h: h @ r


IDS = torch.zeros(1, 3, dtype=torch.long)  # three tokens; the fake ignores their values


def rotation_model() -> FakeModel:
    # Layer i rotates by theta_i at full precision and by theta_i + delta_i in INT4. Rotations commute, so
    # LTS = cos(theta), LRS = cos(delta) and MDS = cos(delta) whatever else is quantized:
    #   layer 0: theta  0, delta 60            LIS = 0.25*1   + 0.25*0.5 + 0.5*0.5 = 0.625
    #   layer 1: theta 90, delta  0            LIS = 0.25*0   + 0.25*1   + 0.5*1   = 0.75
    #   layer 2: theta 60, delta acos(0.8)     LIS = 0.25*0.5 + 0.25*0.8 + 0.5*0.8 = 0.725
    d2 = math.degrees(math.acos(0.8))
    return FakeModel(
        [rotation(0), rotation(90), rotation(60)],
        [rotation(60), rotation(90), rotation(60 + d2)],
        torch.tensor([[1.0, 0.0]], dtype=torch.float64),
    )


def test_static_scores_are_the_hand_computed_cosines():
    lts, lrs = static_scores(rotation_model(), IDS)
    assert lts == pytest.approx([1.0, 0.0, 0.5], abs=1e-12)
    assert lrs == pytest.approx([0.5, 1.0, 0.8], abs=1e-12)


def test_lis_formula_and_greedy_order_by_hand():
    m = rotation_model()
    order, log = greedy_order(m, IDS)
    assert order == [1, 2, 0]
    expected = [(1, 0.0, 1.0, 1.0, 0.75), (2, 0.5, 0.8, 0.8, 0.725), (0, 1.0, 0.5, 0.5, 0.625)]
    for entry, (picked, lts, lrs, mds, lis) in zip(log, expected):
        assert entry["picked"] == picked
        assert (entry["lts"], entry["lrs"], entry["mds"], entry["lis"]) == pytest.approx(
            (lts, lrs, mds, lis), abs=1e-12
        )
    assert all(s.precision is Precision.FULL for s in m.model.slots)  # left at full precision


def mlp_model(seed: int, n: int = 5, dim: int = 6) -> FakeModel:
    """Residual tanh layers (they do not commute); INT4 = the same weights plus a perturbation."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(dim, dim, generator=g, dtype=torch.float64) for _ in range(n)]
    es = [torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.6 for _ in range(n)]
    full = [lambda h, w=w: h + torch.tanh(h @ w) for w in ws]
    int4 = [lambda h, w=w, e=e: h + torch.tanh(h @ (w + e)) for w, e in zip(ws, es)]
    return FakeModel(full, int4, torch.randn(4, dim, generator=g, dtype=torch.float64))


def cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


def reference_order(m: FakeModel) -> tuple[list[int], list[float]]:
    """Every score from a full forward pass from the first layer, the picked set rebuilt each time."""
    n = m.config.num_layers

    def final(q):
        h = m.h0.expand(4, -1)
        for i in range(n):
            h = (m.int4 if i in q else m.full)[i](h)
        return h

    h, inputs = m.h0.expand(4, -1), []
    for i in range(n):
        inputs.append(h)
        h = m.full[i](h)
    lts = [cos(x, m.full[i](x)) for i, x in enumerate(inputs)]
    lrs = [cos(m.full[i](x), m.int4[i](x)) for i, x in enumerate(inputs)]
    chosen, picked_lis = [], []
    while len(chosen) < n:
        ref = final(set(chosen))
        lis = {
            p: 0.25 * lts[p] + 0.25 * lrs[p] + 0.5 * cos(ref, final(set(chosen) | {p}))
            for p in range(n)
            if p not in chosen
        }
        best = max(lis, key=lis.get)
        chosen.append(best)
        picked_lis.append(lis[best])
    return chosen, picked_lis


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_order_matches_a_from_scratch_reference(seed):
    m = mlp_model(seed)
    order, log = greedy_order(m, torch.zeros(1, 4, dtype=torch.long))
    want, want_lis = reference_order(m)
    assert order == want
    assert [e["lis"] for e in log] == pytest.approx(want_lis, abs=1e-12)


def test_mds_is_measured_against_the_set_picked_so_far():
    # On this model the order differs from ranking every layer once against full precision: a greedy that
    # ignored the picked set (static MDS) would fail the reference test above.
    m = mlp_model(0)
    order, log = greedy_order(m, torch.zeros(1, 4, dtype=torch.long))
    m.set_quantized([])
    states, _, _ = m.layer_inputs(torch.zeros(1, 4, dtype=torch.long))
    lts, lrs = static_scores(m, torch.zeros(1, 4, dtype=torch.long))
    static = {}
    for p in range(m.config.num_layers):
        m.set_quantized([p])
        static[p] = 0.25 * lts[p] + 0.25 * lrs[p] + 0.5 * cos(states[-1], m.layer_inputs(torch.zeros(1, 4))[0][-1])
    m.set_quantized([])
    assert order != sorted(static, key=static.get, reverse=True)
