"""tools.eval_quality's perplexity on a hand-computed case: a bigram model whose next-token probabilities are a
known table, scored through the real OfflineModel.nll (shift by one, summed cross-entropy) and the tool's
token-weighted aggregation over batches."""

import math

import pytest
import torch

from engines.offline_model import OfflineModel
from tools.eval_quality import perplexity

# P[current token, next token]
BIGRAM = torch.tensor([[0.50, 0.50], [0.25, 0.75]], dtype=torch.float64)


class BigramModel(OfflineModel):
    """The real nll() over logits that make P(next | current) = BIGRAM[current]; no layers."""

    def __init__(self):  # nothing to load
        self.quantized = None

    def set_quantized(self, layers) -> None:
        self.quantized = list(layers)

    def layer_inputs(self, ids):
        return [ids.flatten()], None, None  # the "final hidden state" is the current token

    def logits(self, h):
        return BIGRAM.log()[h]


def test_perplexity_of_one_window_by_hand():
    ids = torch.tensor([[0, 1, 1, 0]])  # transitions 0->1 (0.5), 1->1 (0.75), 1->0 (0.25)
    m = BigramModel()
    got = perplexity(m, ids, [3, 7])
    assert got == pytest.approx((0.5 * 0.75 * 0.25) ** (-1 / 3), rel=1e-12)  # 2.2013...
    assert got == pytest.approx(2.201284, rel=1e-6)
    assert m.quantized == [3, 7]  # the layers asked for are the ones evaluated


def test_windows_are_pooled_by_token_not_averaged_by_batch():
    ids = torch.tensor(
        [
            [0, 0, 0],  # 0.5, 0.5
            [1, 1, 1],  # 0.75, 0.75
            [1, 0, 1],
        ]
    )  # 0.25, 0.5
    probs = [0.5, 0.5, 0.75, 0.75, 0.25, 0.5]
    expected = math.exp(-sum(math.log(p) for p in probs) / len(probs))
    for batch in (1, 2, 3):  # a batch of 2 splits the windows 2 + 1: still one token-weighted mean
        assert perplexity(BigramModel(), ids, [], batch=batch) == pytest.approx(expected, rel=1e-12)
    # Averaging per-batch perplexities instead would give a different number: the test can tell them apart.
    per_window = [math.exp(-(math.log(a) + math.log(b)) / 2) for a, b in zip(probs[::2], probs[1::2])]
    assert sum(per_window) / 3 != pytest.approx(expected, rel=1e-3)


def test_uniform_logits_give_the_vocabulary_size():
    class Uniform(BigramModel):
        def logits(self, h):
            return torch.zeros(h.shape[0], 49152)

    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    assert perplexity(Uniform(), ids, []) == pytest.approx(49152, rel=1e-5)
