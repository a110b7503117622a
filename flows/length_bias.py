"""The length bias of a pair version: how often the chosen reply is the longer one. A reward
model trained on pairs whose chosen reply is mostly the longer learns to prefer length, so the
feedback validation (:mod:`flows.feedback_validation`) reports the share and warns outside
``LENGTH_BIAS_LOW..LENGTH_BIAS_HIGH``; it never fails on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "LENGTH_BIAS_HIGH",
    "LENGTH_BIAS_LOW",
    "bias_warning",
    "length_notes",
    "measure_length_bias",
]

LENGTH_BIAS_LOW = 0.35
LENGTH_BIAS_HIGH = 0.65


def measure_length_bias(lengths: list[tuple[pd.Series, pd.Series]]) -> dict[str, Any]:
    """How the chosen replies' token counts compare with the rejected ones', over the pairs
    where both were counted: the share where chosen is longer, where the two tie, the means."""
    import pandas as pd

    chosen = pd.concat([c for c, _ in lengths], ignore_index=True).astype("int64")
    rejected = pd.concat([r for _, r in lengths], ignore_index=True).astype("int64")
    counted = (chosen >= 0) & (rejected >= 0)
    chosen, rejected = chosen[counted], rejected[counted]
    pairs = int(counted.sum())
    if pairs == 0:
        return {
            "pairs": 0,
            "chosen_longer_share": None,
            "ties_share": None,
            "chosen_mean_tokens": None,
            "rejected_mean_tokens": None,
            "warning": None,
        }
    longer = float((chosen > rejected).mean())
    return {
        "pairs": pairs,
        "chosen_longer_share": round(longer, 4),
        "ties_share": round(float((chosen == rejected).mean()), 4),
        "chosen_mean_tokens": round(float(chosen.mean()), 2),
        "rejected_mean_tokens": round(float(rejected.mean()), 2),
        "warning": bias_warning(longer),
    }


def bias_warning(chosen_longer_share: float) -> str | None:
    share = f"{chosen_longer_share:.1%}"
    if chosen_longer_share > LENGTH_BIAS_HIGH:
        return (
            f"the chosen reply is the longer one in {share} of pairs (above "
            f"{LENGTH_BIAS_HIGH:.0%}): a reward model trained on them may learn to prefer "
            "longer replies"
        )
    if chosen_longer_share < LENGTH_BIAS_LOW:
        return (
            f"the chosen reply is the longer one in only {share} of pairs (below "
            f"{LENGTH_BIAS_LOW:.0%}): a reward model trained on them may learn to prefer "
            "shorter replies"
        )
    return None


def length_notes(
    length_bias: dict[str, Any], split_reports: dict[str, dict[str, Any]]
) -> list[str]:
    """The lines describe() adds: the chosen-longer share (a length bias a reward model would
    learn), and a warning when it is outside ``LENGTH_BIAS_LOW..LENGTH_BIAS_HIGH``."""
    share = length_bias["chosen_longer_share"]
    if share is None:
        return ["Length bias: no pair had both replies counted."]

    def percent(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    per_split = ", ".join(
        f"{split} {percent(report['length_bias']['chosen_longer_share'])}"
        for split, report in split_reports.items()
    )
    notes = [
        f"Length bias: the chosen reply has more tokens than the rejected one in {percent(share)} "
        f"of {length_bias['pairs']} pairs ({per_split}); ties "
        f"{percent(length_bias['ties_share'])}; mean tokens with the prompt: chosen "
        f"{length_bias['chosen_mean_tokens']}, rejected {length_bias['rejected_mean_tokens']}."
    ]
    if length_bias["warning"] is not None:
        notes.append(f"Warning: {length_bias['warning']}.")
    return notes
