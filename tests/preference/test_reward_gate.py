"""The reward model's gate, by hand: the accuracy floor and the comparison with the current
version on the same held-out pairs are separate rules, each of which can refuse alone."""

from __future__ import annotations

from ppo_core.config.stage_sections import RewardGateConfig
from ppo_core.preference.gate import reward_gate


def test_a_model_above_the_floor_but_worse_than_the_current_version_is_refused():
    """0.80 clears a floor of 0.6 but falls 0.05 below the current version's 0.85, more than
    max_accuracy_drop=0.02 allows: refused on that rule alone. Seen passing with the comparison
    switched off, which no other test caught (their worse model also failed the floor)."""
    rules = RewardGateConfig(min_accuracy=0.6, max_accuracy_drop=0.02)
    decision = reward_gate({"accuracy": 0.80}, {"accuracy": 0.85}, rules)
    assert not decision.promote
    assert decision.reasons[0].startswith("pass: held-out accuracy 0.8000")
    assert decision.reasons[1].startswith("fail: held-out accuracy 0.8000 vs the current")
    # within the allowed drop (0.84 >= 0.85 - 0.02), and with no current version, it passes
    assert reward_gate({"accuracy": 0.84}, {"accuracy": 0.85}, rules).promote
    assert reward_gate({"accuracy": 0.80}, None, rules).promote
    # a current version without a measured accuracy cannot be compared with: refused
    assert not reward_gate({"accuracy": 0.80}, {"accuracy": None}, rules).promote
