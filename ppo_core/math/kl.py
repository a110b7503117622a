"""KL estimators, per-token rewards and KL coefficient controllers.

Estimators of ``KL(pi || ref)`` from samples of ``pi``, written in ``d = log pi - log ref``
(Schulman, "Approximating KL divergence", 2020):

- ``k1 = d`` (unbiased, high variance, can be negative),
- ``k2 = d^2 / 2`` (biased, low variance),
- ``k3 = exp(-d) - 1 + d`` (unbiased, always >= 0),
- ``abs = |d|``.

Per-token rewards follow Ziegler et al. (2019), "Fine-Tuning Language Models from Human
Preferences": ``r_t = -beta * kl_t``, plus the sequence score on the last valid response token.
The adaptive controller is theirs too (section 2.2): ``e = clip(KL / target - 1, -0.2, 0.2)``,
``beta <- beta * (1 + e * n / horizon)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ppo_core.math.declarations import KL_ESTIMATOR_CATALOG, KLEstimator
from ppo_core.math.masked import select

__all__ = [
    "KL_ESTIMATOR_FNS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_estimator",
    "kl_penalty",
    "last_valid_index",
    "token_rewards",
]


KL_ESTIMATOR_FNS = KL_ESTIMATOR_CATALOG
"""Each KL estimator by its name (``kl.estimator``): a function of ``d = log pi - log ref``."""

kl_estimator = KL_ESTIMATOR_FNS.register
"""``@kl_estimator("name")`` registers the decorated ``d -> estimate`` function (elementwise)."""


@kl_estimator("k1")
def _k1(d: Tensor) -> Tensor:
    return d


@kl_estimator("k2")
def _k2(d: Tensor) -> Tensor:
    return 0.5 * d * d


@kl_estimator("k3")
def _k3(d: Tensor) -> Tensor:
    return torch.expm1(-d) + d


@kl_estimator("abs")
def _abs(d: Tensor) -> Tensor:
    return d.abs()


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator = "k1",
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate between the sampling policy and the reference.

    Args:
        logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` the same tokens under the frozen reference.
        estimator: a name of :data:`KL_ESTIMATOR_FNS` (``k1``, ``k2``, ``k3``, ``abs``).
        mask: optional ``[B, T]``; masked positions of the result are 0.

    Returns:
        ``[B, T]`` per-token estimates.
    """
    if mask is not None:
        logprobs = select(logprobs, mask)
        ref_logprobs = select(ref_logprobs, mask)
    kl = KL_ESTIMATOR_FNS[estimator](logprobs - ref_logprobs)
    return kl if mask is None else select(kl, mask)


def last_valid_index(mask: Tensor) -> Tensor:
    """Index of the last True position of each row of a ``[B, T]`` mask, ``-1`` for empty rows.

    Works from positions, not token ids, so a pad token equal to EOS cannot move it
    (docs/design.md section 8).
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).amax(dim=-1)


def token_rewards(
    scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float | Tensor
) -> Tensor:
    """Per-token rewards ``-beta * kl_t`` plus each sequence's score on its last valid token.

    Args:
        scores: ``[B]`` sequence-level scores (reward model, function or scorer).
        kl: ``[B, T]`` per-token KL estimates (see :func:`kl_penalty`).
        response_mask: ``[B, T]`` True on real response tokens, EOS included.
        kl_coef: ``beta``.

    Returns:
        ``[B, T]`` rewards, 0 at masked positions. A row with no valid token gets no score.
    """
    mask = response_mask.bool()
    rewards = select(-kl_coef * select(kl, mask), mask)
    last = last_valid_index(mask)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    rewards = rewards.clone()
    rewards[rows, last[has_token]] += scores[has_token].to(rewards.dtype)
    return rewards


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        """Nothing to adapt; returns the coefficient."""
        return self.value


@dataclass
class AdaptiveKLController:
    """Proportional controller that steers the per-sequence KL towards ``target``.

    Ziegler et al. (2019), section 2.2: ``e = clip(KL / target - 1, -0.2, 0.2)``,
    ``beta <- beta * (1 + e * n_steps / horizon)``.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"adaptive KL target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"adaptive KL horizon must be > 0, got {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt the coefficient after observing ``current_kl`` over ``n_steps`` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
