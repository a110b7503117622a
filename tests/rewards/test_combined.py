"""Several rewards as one: ``model.reward`` plus ``model.reward_terms``, weighed."""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import ConfigError, load_config
from ppo_core.rewards.combined import WeightedReward, term_names


def test_term_names_are_metric_names_and_distinct():
    names = term_names(
        [
            "builtin:math_answer",
            "checks:has_format",
            "/models/My-Reward",
            "reward:r0002",
            "checks.more:has_format",
            "builtin:3way",
        ]
    )
    assert names == [
        "math_answer",
        "has_format",
        "my_reward",
        "reward_r0002",
        "has_format_2",
        "r_3way",
    ]


def test_the_score_is_the_weighted_sum_and_each_term_is_kept():
    """Hand-computed: 1.0 * [1, 0] + 0.5 * [0.2, 0.4] + (-2) * [0, 1] = [1.1, -1.8]."""

    class Verifier:
        def __init__(self) -> None:
            self.last_reasons = {"correct": 1, "wrong": 1}

        def __call__(self, prompts, responses, references=None):
            return torch.tensor([1.0, 0.0])

    def length(prompts, responses, references=None):
        return torch.tensor([len(r) / 10 for r in responses])

    def penalty(prompts, responses, references=None):
        return torch.tensor([0.0, 1.0])

    reward = WeightedReward([Verifier(), length, penalty], [1.0, 0.5, -2.0], ["v", "length", "p"])
    scores = reward(["a", "b"], ["xx", "xxxx"], {"answer": ["1", "2"]})
    torch.testing.assert_close(scores, torch.tensor([1.1, -1.8]))
    assert set(reward.last_terms) == {"v", "length", "p"}
    torch.testing.assert_close(reward.last_terms["length"], torch.tensor([0.2, 0.4]))
    assert reward.last_reasons == {"correct": 1, "wrong": 1}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.reward_terms=[builtin:afinn]", "model.reward_weights=[1.0]"], "1 weights for 2"),
        (["model.reward_weights=[1.0, 2.0]"], "2 weights for 1"),
        (["model.reward_weights=[.nan]"], "finite"),
    ],
)
def test_weights_that_do_not_fit_the_rewards_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
