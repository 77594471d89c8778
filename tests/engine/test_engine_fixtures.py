"""The near-tie rule the batching tests compare greedy runs with: only the gap where the runs part excuses it."""

import pytest
from tests.engine_fixtures import NEAR_TIE, assert_same_up_to_near_tie


def test_equal_runs_pass():
    assert_same_up_to_near_tie([5, 6, 7], [1.0, 1.0, 1.0], [5, 6, 7])


def test_divergence_at_a_near_tie_passes():
    assert_same_up_to_near_tie([5, 6, 7], [1.0, NEAR_TIE / 2, 1.0], [5, 9, 8])


def test_an_earlier_near_tie_does_not_excuse_a_later_divergence():
    # Token 0 was a near tie but both runs picked 5; the divergence at 2 had a clear winner.
    with pytest.raises(AssertionError, match="diverged at token 2"):
        assert_same_up_to_near_tie([5, 6, 7], [NEAR_TIE / 2, 1.0, 1.0], [5, 6, 8])


def test_lengths_must_match():
    with pytest.raises(AssertionError):
        assert_same_up_to_near_tie([5, 6], [1.0, 1.0], [5, 6, 7])
