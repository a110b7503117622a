"""pass@k by Chen et al.'s unbiased estimator, against cases counted by hand."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from ppo_core.math.pass_at_k import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (4, 1, 1, 0.25),  # one draw, one correct reply of four
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 3, 3, 1.0),  # two wrong replies cannot fill three draws
        (10, 0, 5, 0.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_share_of_draws_holding_a_correct_reply():
    """Every k-subset of 6 replies (2 correct) enumerated: the estimator is their share."""
    replies = [True, True, False, False, False, False]
    for k in range(1, 7):
        subsets = list(itertools.combinations(replies, k))
        share = sum(any(s) for s in subsets) / len(subsets)
        assert len(subsets) == comb(6, k)
        assert pass_at_k(6, 2, k) == pytest.approx(share, abs=1e-12)


def test_the_mean_over_problems_and_what_is_refused():
    assert mean_pass_at_k([0, 1, 4], n=4, k=1) == pytest.approx((0 + 0.25 + 1) / 3)
    with pytest.raises(ValueError, match=r"n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=r"k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="no problem"):
        mean_pass_at_k([], 4, 1)
