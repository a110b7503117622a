"""Task metrics (layer 3): how often replies are right, when the reward checks them against the
answer each prompt row carries (``data.reference_fields``, a verifier reward).

A reply counts as correct when its score is at least :data:`CORRECT_SCORE` (a verifier's 1.0).
``accuracy`` is the share of correct replies; ``pass_at_<k>`` the unbiased estimate of pass@k
(Chen et al. 2021) that one of ``k`` replies to a prompt is correct, for ``k`` = 1 and
``eval.samples_per_prompt``; ``verdict/<why>`` the share of replies each verdict reason
(``correct``, ``wrong``, ``unparsed``, ``timeout``, ...) covers, where the reward counts them;
``accuracy/<task>`` the accuracy of each task's replies, where the rows carry a ``task`` field
(``ppo tasks`` writes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ppo_core.math.pass_at_k import mean_pass_at_k
from ppo_core.rewards.combined import metric_name
from ppo_core.rewards.verifiers import reason_counts

__all__ = ["CORRECT_SCORE", "task_metrics"]

CORRECT_SCORE = 1.0
"""The score from which a reply counts as correct (a verifier gives 1.0 to a right answer)."""


def task_metrics(
    scores: torch.Tensor,
    samples_per_prompt: int,
    reward_fn: Any,
    tasks: Sequence[Any] | None = None,
) -> dict[str, float]:
    """Accuracy, pass@1 and pass@k of ``scores`` ``[P * k]`` (the ``k`` replies of each prompt
    consecutive), the share of each reason the reward counted for them, and with ``tasks`` (each
    reply's row's ``task`` field) the accuracy of each task."""
    correct = (scores >= CORRECT_SCORE).reshape(-1, samples_per_prompt).sum(dim=1).tolist()
    metrics = {
        "accuracy": float((scores >= CORRECT_SCORE).float().mean()),
        "pass_at_1": mean_pass_at_k(correct, samples_per_prompt, 1),
    }
    if samples_per_prompt > 1:
        metrics[f"pass_at_{samples_per_prompt}"] = mean_pass_at_k(
            correct, samples_per_prompt, samples_per_prompt
        )
    reasons = reason_counts(reward_fn)
    if reasons:
        total = sum(reasons.values())
        metrics.update({f"verdict/{why}": count / total for why, count in sorted(reasons.items())})
    if tasks is not None:
        metrics.update(_accuracy_by_task(scores, tasks))
    return metrics


def _accuracy_by_task(scores: torch.Tensor, tasks: Sequence[Any]) -> dict[str, float]:
    """``accuracy/<task>`` for each task of the replies, its name made a metric name
    (``[a-z][a-z0-9_]*``)."""
    right: dict[str, list[bool]] = {}
    for score, task in zip(scores.tolist(), tasks, strict=True):
        name = metric_name(str(task), "task")
        right.setdefault(name, []).append(score >= CORRECT_SCORE)
    return {f"accuracy/{name}": sum(hits) / len(hits) for name, hits in sorted(right.items())}
