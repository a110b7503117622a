"""The gate between a newly trained reward model and the current one (layer 3): the new one
replaces it only when its held-out accuracy is at least ``reward_model.gate.min_accuracy`` and
at least the incumbent's on the same held-out pairs, less ``max_accuracy_drop``. A rejected
model leaves the current version, and so PPO's reward, as it was."""

from __future__ import annotations

import math

from ppo_core.config.stage_sections import RewardGateConfig
from ppo_core.registry.gate import GateDecision

__all__ = ["reward_gate"]


def reward_gate(
    new: dict[str, float | None], incumbent: dict[str, float | None] | None, rules: RewardGateConfig
) -> GateDecision:
    """One reason a rule, passing or not; ``incumbent`` is None before the first version."""
    found = new.get("accuracy")
    accuracy = math.nan if found is None else found
    reasons = []
    if not math.isfinite(accuracy):
        return GateDecision(False, ["fail: cannot judge: the new reward model has no accuracy"])
    floor_ok = accuracy >= rules.min_accuracy
    reasons.append(
        f"{'pass' if floor_ok else 'fail'}: held-out accuracy {accuracy:.4f} "
        f"(needs >= {rules.min_accuracy}, reward_model.gate.min_accuracy)"
    )
    passed = floor_ok
    if incumbent is None:
        reasons.append("pass: no current reward version to compare with")
    else:
        before = incumbent.get("accuracy")
        before = math.nan if before is None else before
        needed = before - rules.max_accuracy_drop
        ok = math.isfinite(before) and accuracy >= needed - 1e-12
        reasons.append(
            f"{'pass' if ok else 'fail'}: held-out accuracy {accuracy:.4f} vs the current "
            f"version's {before:.4f} on the same pairs (may fall by at most "
            f"{rules.max_accuracy_drop}, reward_model.gate.max_accuracy_drop)"
        )
        passed = passed and ok
    return GateDecision(passed, reasons)
