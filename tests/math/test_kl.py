import math

import pytest
import torch

from ppo_core import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    last_valid_index,
    token_rewards,
)
from tests.helpers import assert_close


def test_estimators_hand_computed():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # d = logp - ref = [0.5, -1.0]
    assert_close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    # k2 = d^2 / 2 = [0.125, 0.5]
    assert_close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    # k3 = exp(-d) - 1 + d = [e^-0.5 - 0.5, e^1 - 2]
    assert_close(kl_penalty(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0]])
    assert_close(kl_penalty(logp, ref, "abs"), [[0.5, 1.0]])


def test_k3_is_nonnegative_and_estimators_reject_unknown():
    d = torch.linspace(-5, 5, 101)
    assert (kl_penalty(d, torch.zeros_like(d), "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_penalty(d, d, "k9")


def test_kl_mask_hides_garbage():
    logp = torch.tensor([[-1.0, float("nan")]])
    ref = torch.tensor([[-2.0, float("inf")]])
    mask = torch.tensor([[True, False]])
    assert_close(kl_penalty(logp, ref, "k3", mask), [[math.exp(-1) - 1 + 1, 0.0]])


def test_last_valid_index_uses_positions():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]]).bool()
    assert last_valid_index(mask).tolist() == [1, 3, -1, 2]


def test_token_rewards_hand_computed():
    scores = torch.tensor([2.0, -1.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 0.0, 0.5], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]]).bool()
    rewards = token_rewards(scores, kl, mask, kl_coef=0.5)
    # row 0: [-0.05, -0.1 + 2.0, 0 (masked)]
    # row 1: [-0.15, 0.0, -0.25 - 1.0]
    # row 2: no valid token, no score anywhere
    expected = [[-0.05, 1.9, 0.0], [-0.15, 0.0, -1.25], [0.0, 0.0, 0.0]]
    assert_close(rewards, expected)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 64) == 0.05


def test_adaptive_controller_hand_computed():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    # KL 12: e = clip(12/6 - 1, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000)
    assert ctl.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    # KL 5.4: e = 5.4/6 - 1 = -0.1; beta = 0.1 * (1 - 0.1 * 100 / 10000)
    assert ctl.update(5.4, 100) == pytest.approx(0.1 * (1 - 0.1 * 100 / 10000))
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(value=0.1, target=0.0, horizon=1)
