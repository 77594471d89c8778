import pytest
import torch

from trtllm_backend.errors import InvalidRequest
from trtllm_backend.sampling import SamplingParams, apply_penalties, sample


def logits():
    return torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])


def test_greedy_and_top_k_1_pick_argmax():
    assert sample(logits(), [SamplingParams()], [None]) == [1]
    assert sample(logits(), [SamplingParams(temperature=5.0, top_k=1)], [None]) == [1]


def test_seeded_sampling_is_reproducible_and_varies():
    p = SamplingParams(temperature=2.0, seed=3)
    runs = [
        [sample(logits(), [p], [g])[0] for _ in range(30)]
        for g in (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))
    ]
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
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_unknown_fields_are_rejected():
    with pytest.raises(InvalidRequest, match="bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})


# --- frequency / presence penalties (OpenAI's rule, checked against numbers worked out by hand) ---------------
def test_penalties_match_the_hand_computed_logits():
    # Generated so far: token 1 twice, token 2 once. frequency 0.5, presence 0.2:
    #   token 1: 3.0 - 2 * 0.5 - 0.2 = 1.8;  token 2: 2.9 - 1 * 0.5 - 0.2 = 2.2;  the others are untouched.
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.2)
    got = apply_penalties(logits(), [p], [[1, 2, 1]])
    assert torch.allclose(got, torch.tensor([[0.0, 1.8, 2.2, -1.0, 1.0]]))
    assert torch.equal(logits(), torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]))  # the caller's logits stay as they were


def test_penalties_change_the_greedy_pick_and_negative_ones_favour_repeats():
    assert sample(logits(), [SamplingParams(presence_penalty=0.2)], [None], [[1]]) == [2]  # 2.8 < 2.9
    assert sample(logits(), [SamplingParams(presence_penalty=0.05)], [None], [[1]]) == [1]  # 2.95 > 2.9
    # A negative frequency penalty raises token 4 (1.0 + 3 * 1.5 = 5.5) above token 1.
    assert sample(logits(), [SamplingParams(frequency_penalty=-1.5)], [None], [[4, 4, 4]]) == [4]


def test_penalties_apply_per_row_only_where_set():
    batch = torch.cat([logits(), logits()])
    got = apply_penalties(batch, [SamplingParams(), SamplingParams(frequency_penalty=1.0)], [[1, 1], [1, 1]])
    assert torch.equal(got[0], batch[0])
    assert torch.allclose(got[1], torch.tensor([0.0, 1.0, 2.9, -1.0, 1.0]))
    assert sample(batch, [SamplingParams(), SamplingParams(frequency_penalty=1.0)], [None, None], [[1, 1], [1, 1]]) == [
        1,
        2,
    ]


def test_penalized_sampling_draws_from_the_penalized_distribution():
    # Same seed, same draws as sampling the hand-penalized logits with no penalty.
    penalized = SamplingParams(temperature=1.0, seed=5, frequency_penalty=0.5, presence_penalty=0.2)
    by_hand = torch.tensor([[0.0, 1.8, 2.2, -1.0, 1.0]])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = [sample(logits(), [penalized], [g1], [[1, 2, 1]])[0] for _ in range(40)]
    b = [sample(by_hand, [SamplingParams(temperature=1.0)], [g2])[0] for _ in range(40)]
    assert a == b and len(set(a)) > 1


def test_penalties_without_the_generated_ids_are_refused():
    with pytest.raises(ValueError, match="generated token ids"):
        sample(logits(), [SamplingParams(presence_penalty=0.5)], [None])


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 3.4e38])
def test_extreme_temperatures_sample_without_nan(temperature):
    # Found by fuzzing the server: logits / 1e-45 overflowed to inf and softmax gave nan (multinomial raised).
    logits = torch.tensor([[2.0, 5.0, 1.0, 5.0 - 1e-3]])
    gen = torch.Generator().manual_seed(0)
    token = sample(logits, [SamplingParams(temperature=temperature)], [gen])[0]
    if temperature < 1:
        assert token == 1  # a vanishing temperature is greedy
    else:
        assert 0 <= token < 4
