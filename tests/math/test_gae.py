import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import compute_gae, masked_mean, masked_var, whiten_advantages
from tests.helpers import assert_close, examples


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python: for each row, walk its valid positions backwards."""
    advantages = torch.zeros_like(values)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            adv = delta + gamma * lam * next_adv
            advantages[b, t] = adv
            next_value, next_adv = values[b, t].item(), adv
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    gamma, lam = 0.9, 0.5
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # t=2: delta = 1 + 0 - 0.5 = 0.5;             A2 = 0.5
    # t=1: delta = 0 + 0.9*0.5 - 0.25 = 0.2;      A1 = 0.2 + 0.45*0.5 = 0.425
    # t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275;   A0 = -0.275 + 0.45*0.425 = -0.08375
    assert_close(adv, [[-0.08375, 0.425, 0.5]])
    assert_close(ret, [[-0.08375 + 0.5, 0.425 + 0.25, 1.0]])


def test_gae_skips_masked_positions_and_ignores_garbage():
    rewards = torch.tensor([[1.0, float("nan"), 1.0, float("inf")]])
    values = torch.tensor([[1.0, float("nan"), 1.0, -float("inf")]])
    mask = torch.tensor([[True, False, True, False]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # valid t=2: delta = 1 + 0 - 1 = 0;  t=0: delta = 1 + V2 - V0 = 1; A0 = 1 + A2 = 1
    assert adv.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert ret.tolist() == [[2.0, 0.0, 1.0, 0.0]]


@settings(max_examples=examples(50), deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 9),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_matches_reference_loop(rows, cols, gamma, lam, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    values = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=gen) < 0.7
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)


def test_whiten_advantages_once_per_batch():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(8, 5, generator=gen, dtype=torch.float64) * 4 + 2
    mask = torch.rand(8, 5, generator=gen) < 0.8
    white = whiten_advantages(adv, mask)
    assert masked_mean(white, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(white, mask).item() == pytest.approx(1.0, abs=1e-6)
    assert (white[~mask] == 0).all()
