import pytest
import torch

from trtllm_backend.errors import InvalidRequest
from trtllm_backend.sampling import SamplingParams, sample


def logits():
    return torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])


def test_greedy_and_top_k_1_pick_argmax():
    assert sample(logits(), [SamplingParams()], [None]) == [1]
    assert sample(logits(), [SamplingParams(temperature=5.0, top_k=1)], [None]) == [1]


def test_seeded_sampling_is_reproducible_and_varies():
    p = SamplingParams(temperature=2.0, seed=3)
    runs = [[sample(logits(), [p], [g])[0] for _ in range(30)] for g in (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_top_k_and_top_p_cut_the_tail():
    g = torch.Generator().manual_seed(0)
    picks = {sample(logits(), [SamplingParams(temperature=1.0, top_k=2)], [g])[0] for _ in range(200)}
    assert picks == {1, 2}
    picks = {sample(logits(), [SamplingParams(temperature=1.0, top_p=0.01)], [g])[0] for _ in range(50)}
    assert picks == {1}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": -2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_unknown_fields_are_rejected():
    with pytest.raises(InvalidRequest, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
