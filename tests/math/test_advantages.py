"""The advantage estimators against plain Python, on random masks, groups of unequal sizes and
all-masked rows (float64, 1e-12)."""

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.math.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    consecutive_groups,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from ppo_core.math.declarations import ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS
from ppo_core.math.gae import compute_gae, whiten_advantages
from tests.helpers import examples

TOL = dict(rtol=1e-12, atol=1e-12)


def reference_grpo(scores, groups, mask, eps=1e-6):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, g in enumerate(groups):
        mine = [float(scores[j]) for j in range(len(groups)) if groups[j] == g]
        mean = sum(mine) / len(mine)
        std = math.sqrt(sum((s - mean) ** 2 for s in mine) / (len(mine) - 1))
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = (float(scores[i]) - mean) / (std + eps)
    return out


def reference_dr_grpo(scores, groups, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, g in enumerate(groups):
        mine = [float(scores[j]) for j in range(len(groups)) if groups[j] == g]
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = float(scores[i]) - sum(mine) / len(mine)
    return out


def reference_rloo(scores, groups, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, g in enumerate(groups):
        others = [float(scores[j]) for j in range(len(groups)) if groups[j] == g and j != i]
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = float(scores[i]) - sum(others) / len(others)
    return out


def reference_reinforce_pp(rewards, mask, gamma):
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        running = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[b, t]:
                running = float(rewards[b, t]) + gamma * running
                returns[b, t] = running
    valid = [float(returns[b, t]) for b, t in zip(*mask.nonzero(as_tuple=True), strict=True)]
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((g - mean) ** 2 for g in valid) / (len(valid) - 1))
    scale = math.sqrt(std**2 + 1e-8)
    return torch.where(mask, (returns - mean) / scale, torch.zeros_like(returns))


def random_batch(seed: int, group_sizes: list[int], length: int):
    """Scores, per-token rewards with NaN where masked, a random mask with one all-masked row,
    and shuffled group ids of the given sizes."""
    rng = random.Random(seed)
    groups = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    rng.shuffle(groups)
    rows = len(groups)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, generator=generator, dtype=torch.float64)
    mask = torch.rand(rows, length, generator=generator) < 0.7
    mask[rng.randrange(rows)] = False
    mask[(rng.randrange(rows) + 1) % rows, 0] = True  # at least one valid token somewhere
    rewards = torch.randn(rows, length, generator=generator, dtype=torch.float64)
    rewards = torch.where(mask, rewards, torch.full_like(rewards, float("nan")))
    return scores, rewards, mask, groups


group_sizes = st.lists(st.integers(2, 5), min_size=1, max_size=5)


@pytest.mark.parametrize(
    ("estimator", "reference"),
    [
        (grpo_advantages, reference_grpo),
        (dr_grpo_advantages, reference_dr_grpo),
        (rloo_advantages, reference_rloo),
    ],
    ids=["grpo", "dr_grpo", "rloo"],
)
@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10_000), sizes=group_sizes, length=st.integers(1, 6))
def test_group_estimators_match_plain_python(estimator, reference, seed, sizes, length):
    scores, _, mask, groups = random_batch(seed, sizes, length)
    got = estimator(scores, torch.tensor(groups), mask)
    torch.testing.assert_close(got, reference(scores, groups, mask), **TOL)


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=group_sizes,
    length=st.integers(2, 6),
    gamma=st.sampled_from([1.0, 0.9]),
)
def test_reinforce_pp_matches_plain_python(seed, sizes, length, gamma):
    _, rewards, mask, _ = random_batch(seed, sizes, length)
    mask[0, :2] = True  # at least two valid tokens, for the batch's standard deviation
    rewards = torch.where(mask & rewards.isnan(), torch.ones_like(rewards), rewards)
    got = reinforce_pp_advantages(rewards, mask, gamma)
    torch.testing.assert_close(got, reference_reinforce_pp(rewards, mask, gamma), **TOL)


def test_grpo_and_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, 1, dtype=torch.bool)
    # group 0: mean 1, std 1 (Bessel); group 1: all equal, advantage 0
    assert grpo_advantages(scores, groups, mask, eps=0.0).nan_to_num().flatten().tolist() == [
        0.0,
        -1.0,
        1.0,
        0.0,
        0.0,
    ]
    # Dr. GRPO: the group mean only, 1 - 1 = 0, 0 - 1 = -1, 2 - 1 = 1, 5 - 5 = 0
    assert dr_grpo_advantages(scores, groups, mask).flatten().tolist() == [0.0, -1.0, 1.0, 0, 0]
    # leave-one-out: 1 - (0 + 2) / 2 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5
    assert rloo_advantages(scores, groups, mask).flatten().tolist() == [0.0, -1.5, 1.5, 0.0, 0.0]


def test_an_all_masked_row_counts_in_its_group_but_reaches_no_token():
    scores = torch.tensor([3.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0])
    mask = torch.tensor([[False, False], [True, True]])
    # the first response has no token, yet its score is the second's baseline
    assert rloo_advantages(scores, groups, mask).tolist() == [[0.0, 0.0], [-2.0, -2.0]]


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_a_group_of_one_is_refused(estimator):
    with pytest.raises(ValueError, match="at least 2 samples of each prompt"):
        estimator(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), torch.ones(3, 2))


def test_consecutive_groups():
    assert consecutive_groups(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="group_size=4 must be >= 1 and divide the batch of 6"):
        consecutive_groups(6, 4)


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 10_000), sizes=group_sizes)
def test_group_estimators_do_not_depend_on_row_order(seed, sizes):
    scores, _, mask, groups = random_batch(seed, sizes, 4)
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))
    ids = torch.tensor(groups)
    for estimator in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        whole = estimator(scores, ids, mask)
        shuffled = estimator(scores[order], ids[order], mask[order])
        torch.testing.assert_close(shuffled, whole[order], **TOL)


def test_the_registry_runs_each_estimator_by_name():
    scores, rewards, mask, groups = random_batch(3, [2, 3], 4)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.randn(mask.shape, dtype=torch.float64)
    inputs = AdvantageInputs(
        scores=scores,
        rewards=rewards,
        response_mask=mask,
        gamma=0.9,
        lam=0.8,
        values=values,
        group_ids=torch.tensor(groups),
    )
    gae_advantages, gae_returns = compute_gae(rewards, values, mask, 0.9, 0.8)
    expected = {
        "gae": (whiten_advantages(gae_advantages, mask), gae_returns),
        "grpo": (grpo_advantages(scores, torch.tensor(groups), mask), None),
        "dr_grpo": (dr_grpo_advantages(scores, torch.tensor(groups), mask), None),
        "rloo": (rloo_advantages(scores, torch.tensor(groups), mask), None),
        "reinforce_pp": (reinforce_pp_advantages(rewards, mask, 0.9), None),
    }
    assert set(ESTIMATORS) == set(expected) == set(ADVANTAGE_ESTIMATORS) == set(ESTIMATOR_NEEDS)
    for name, (advantages, returns) in expected.items():
        got_advantages, got_returns = ESTIMATORS[name](inputs)
        # what the registry says each needs is what it reads: returns only with a critic, and
        # no run without the groups where it compares samples
        assert (got_returns is not None) == ESTIMATOR_NEEDS[name].critic, name
        if ESTIMATOR_NEEDS[name].groups:
            with pytest.raises(ValueError, match="needs the group of each row"):
                ESTIMATORS[name](dataclasses.replace(inputs, group_ids=None))
        torch.testing.assert_close(got_advantages, advantages, **TOL)
        if returns is None:
            assert got_returns is None
        else:
            torch.testing.assert_close(got_returns, returns, **TOL)
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        ESTIMATORS["gae"](AdvantageInputs(scores, rewards, mask))
    with pytest.raises(ValueError, match="grpo needs the group of each row"):
        ESTIMATORS["grpo"](AdvantageInputs(scores, rewards, mask))


def test_the_estimators_in_their_order():
    assert ADVANTAGE_ESTIMATORS == ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp")


def test_two_estimators_of_one_name_are_refused():
    from ppo_core.math.advantages import estimator

    with pytest.raises(ValueError, match="two advantage estimators are named 'rloo'"):
        estimator("rloo", critic=False, groups=True)(lambda inputs: (inputs.scores, None))
