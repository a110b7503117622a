"""The promotion gate (layer 3): a candidate's held-out metrics against the baseline's, rule
by rule (docs/design.md section 8), decided before :mod:`ppo_core.registry.versions` records the
decision."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ppo_core.config import PromoteConfig

__all__ = ["GateDecision", "gate"]


@dataclass
class GateDecision:
    """Whether a candidate passes, and why (one reason per rule, passing or not)."""

    promote: bool
    reasons: list[str]


class Unjudgeable(Exception):
    """A metric a gate rule reads is missing or not a finite number (the reason says which)."""


def _metric(metrics: dict[str, float] | None, side: str, key: str, why: str = "") -> float:
    """``metrics[key]`` as a finite float, else :class:`Unjudgeable` naming the side and key."""
    if metrics is None:
        raise Unjudgeable(
            f"metrics.json has no {side} metrics, so {side} {key} cannot be compared; run "
            "`ppo evaluate` with a baseline (eval.baseline, the production version or "
            "model.policy)"
        )
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Unjudgeable(f"{side} {key} is missing from metrics.json{why}")
    if not math.isfinite(value):
        raise Unjudgeable(f"{side} {key} is {value}, not a finite number")
    return float(value)


def gate(
    candidate: dict[str, float],
    baseline: dict[str, float] | None,
    rules: PromoteConfig,
    max_new_tokens: int | None = None,
) -> GateDecision:
    """Apply the promotion rules ``rules`` (``promote.*``) to held-out metrics (as written by
    ``ppo evaluate``): the score gain, the KL budget, the drift from the chain's origin and the
    EOS rate, then the guards against a gamed reward, each comparing the candidate with the
    baseline (docs/design.md section 8).

    The gate refuses what it cannot judge: a metric that a rule reads, of the candidate or the
    baseline, that is missing, NaN or infinite fails that rule, naming the metric, and so does
    a missing baseline. ``max_new_tokens`` (``generation.max_new_tokens``) is named in the EOS
    rule's reason when the rule fails."""
    checks = [lambda: _score_rule(candidate, baseline, rules)]
    significance = rules.min_gain_se
    if significance is not None:
        checks.append(lambda: _gain_se_rule(candidate, baseline, significance))
    checks += [
        lambda: _at_most(
            _metric(candidate, "candidate", "kl_to_reference"),
            rules.max_kl,
            "KL to reference {:.3f} nats (budget {})",
        ),
    ]
    drift_limit = rules.max_kl_from_origin
    if drift_limit is not None:
        checks.append(
            lambda: _at_most(
                _metric(candidate, "candidate", "kl_to_origin"),
                drift_limit,
                "KL to the chain's origin {:.3f} nats (promote.max_kl_from_origin {})",
            )
        )
    checks.append(lambda: _eos_rule(candidate, baseline, rules, max_new_tokens))
    margins = {
        "distinct_2": rules.max_distinct_2_drop,
        "reference_nll": rules.max_nll_increase,
        "check_score": None if rules.check_reward is None else rules.max_check_drop,
        # measured when the candidate trained on a reward version that replaced another: a gain
        # the new reward model alone sees is not a gain
        "previous_reward_score": (
            rules.max_check_drop if "previous_reward_score" in candidate else None
        ),
    }
    checks += [
        functools.partial(_guard, candidate, baseline, metric, margin)
        for metric, margin in margins.items()
        if margin is not None
    ]
    rules_met: list[tuple[bool, str]] = []
    for check in checks:
        try:
            rules_met.append(check())
        except Unjudgeable as missing:
            rules_met.append((False, f"cannot judge: {missing}"))
    return GateDecision(
        all(ok for ok, _ in rules_met),
        [("pass: " if ok else "FAIL: ") + text for ok, text in rules_met],
    )


def _at_most(value: float, limit: float, text: str) -> tuple[bool, str]:
    return value <= limit, text.format(value, limit)


def _score_rule(
    candidate: dict[str, float], baseline: dict[str, float] | None, rules: PromoteConfig
) -> tuple[bool, str]:
    score = _metric(candidate, "candidate", "score")
    base_score = _metric(baseline, "baseline", "score")
    gain = score - base_score
    return gain >= rules.min_improvement, (
        f"score {score:.4f} vs baseline {base_score:.4f}: gain {gain:+.4f} (needs >= "
        f"{rules.min_improvement:+.4f})"
    )


def _gain_se_rule(
    candidate: dict[str, float], baseline: dict[str, float] | None, needed: float
) -> tuple[bool, str]:
    """The score gain in standard errors of the difference of two means, each side's from its
    ``score_std`` and ``num_samples``: ``gain / sqrt(sd_c^2 / n_c + sd_b^2 / n_b)``."""
    gain = _metric(candidate, "candidate", "score") - _metric(baseline, "baseline", "score")
    spread = 0.0
    for side, metrics in (("candidate", candidate), ("baseline", baseline)):
        samples = _metric(metrics, side, "num_samples")
        if samples < 1:
            raise Unjudgeable(f"{side} num_samples is {samples:g}")
        spread += _metric(metrics, side, "score_std") ** 2 / samples
    error = math.sqrt(spread)
    ratio = gain / error if error > 0 else (math.inf if gain > 0 else 0.0)
    return ratio >= needed, (
        f"score gain {gain:+.4f} is {ratio:.2f} standard errors ({error:.4f}; needs >= "
        f"{needed:g}, promote.min_gain_se)"
    )


def _eos_rule(
    candidate: dict[str, float],
    baseline: dict[str, float] | None,
    rules: PromoteConfig,
    max_new_tokens: int | None,
) -> tuple[bool, str]:
    """The EOS floor; a failing reason shows the baseline's rate, that responses without EOS
    were cut at ``generation.max_new_tokens``, and the keys that change the outcome."""
    rate = _metric(candidate, "candidate", "eos_rate")
    text = f"EOS rate {rate:.3f} (needs >= {rules.min_eos_rate})"
    if rate >= rules.min_eos_rate:
        return True, text
    base_rate = (baseline or {}).get("eos_rate")
    if isinstance(base_rate, int | float) and math.isfinite(base_rate):
        text += f"; the baseline's is {base_rate:.3f}"
        if base_rate < rules.min_eos_rate:
            text += " (below the floor too)"
    cut = "" if max_new_tokens is None else f"={max_new_tokens}"
    text += (
        f"; responses without EOS were cut at generation.max_new_tokens{cut}: raise it, or "
        "lower promote.min_eos_rate"
    )
    return False, text


GUARDS = {
    "distinct_2": ("distinct-2", "promote.max_distinct_2_drop", -1),
    "reference_nll": ("reference NLL (nats/token)", "promote.max_nll_increase", +1),
    "check_score": ("check score", "promote.check_reward", -1),
    "previous_reward_score": (
        "score on the previous reward version",
        "promote.max_check_drop bounds it; model.reward",
        -1,
    ),
}
"""The guard metrics: how a reason names each, the key that switches it on, and which way is
worse (-1: falling, +1: rising)."""


def _guard(
    candidate: dict[str, float], baseline: dict[str, float] | None, metric: str, margin: float
) -> tuple[bool, str]:
    """The rule that ``metric`` gets worse (the way :data:`GUARDS` names) by at most ``margin``
    from the baseline's. A metric missing on either side (not measured, or a baseline with
    another tokenizer than the reference, which has no reference NLL) is :class:`Unjudgeable`,
    and the reason names the key that turns the guard off."""
    name, key, worse = GUARDS[metric]
    off = f" ({key} asks for it; set it to null to promote without this guard)"
    value = _metric(candidate, "candidate", metric, f": run `ppo evaluate` again{off}")
    base_value = _metric(baseline, "baseline", metric, off)
    change = value - base_value
    return change * worse <= margin, (
        f"{name} {value:.4f} vs baseline {base_value:.4f}: change "
        f"{change:+.4f} (may {'fall' if worse < 0 else 'rise'} by at most {margin})"
    )
