"""PPO token losses, masked statistics and loss aggregation.

Token losses (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7; the value
clipping of OpenAI's baselines ``ppo2``; dual clip from Ye et al. 2020, "Mastering Complex Control
in MOBA Games with Deep Reinforcement Learning", eq. 5):

    rho      = exp(logp - old_logp)
    pg_loss  = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
    dual     = min(pg_loss, -A c)          for A < 0, when a dual-clip constant c > 1 is given
    vf_loss  = 0.5 max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)

Every function returns **per-token** losses, zero at masked positions, and statistics as
:class:`RunningMean` (token-weighted), so that micro-batches, mini-batches and ranks merge into
exact means. Reduction to a scalar happens in :func:`aggregate_loss`, which returns a sum and a
count instead of a mean: see docs/design.md section 4 and :mod:`ppo_core.math.accumulation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_core.math.declarations import LOSS_AGGREGATION_CATALOG, LossAggMode
from ppo_core.math.masked import select
from ppo_core.math.running_mean import RunningMean

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossParts",
    "PolicyLossOutput",
    "ValueLossOutput",
    "aggregate_loss",
    "count_units",
    "entropy_from_logits",
    "logprobs_from_logits",
    "loss_aggregation",
    "policy_loss",
    "truncated_importance_weights",
    "value_loss",
]


class PolicyLossOutput(NamedTuple):
    """Clipped policy loss per token and its masked statistics."""

    token_losses: Tensor  # [B, T], 0 where masked
    clipfrac: RunningMean  # fraction of tokens where the clipped branch was taken
    dual_clipfrac: RunningMean  # fraction of tokens where the dual clip bound was taken
    approx_kl: RunningMean  # k3 estimate of KL(old || new): (rho - 1) - log rho
    ratio: RunningMean  # mean of rho


class ValueLossOutput(NamedTuple):
    """Clipped value loss per token and its masked statistics."""

    token_losses: Tensor  # [B, T], 0 where masked
    clipfrac: RunningMean  # fraction of tokens where the clipped value had the larger error
    error: RunningMean  # mean of (V - R)^2, unclipped


@dataclass(frozen=True)
class LossParts:
    """A micro-batch's share of a mini-batch objective, before normalisation.

    ``total`` is differentiable; ``count`` is the number of units (tokens or sequences, per
    aggregation mode) it covers. The mini-batch objective is ``sum(total) / sum(count)`` over all
    micro-batches on all ranks.
    """

    total: Tensor  # scalar, float32 or float64
    count: Tensor  # scalar int64


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]``.
        tokens: ``[B, T]`` token ids.
        temperature: the sampling temperature, so that the scored distribution is the sampled one.

    Returns:
        ``[B, T]``, computed in float32 at least.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    gathered = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return gathered - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: ``[B, T, V] -> [B, T]``.

    ``H = logsumexp(z) - sum(softmax(z) z)``.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def truncated_importance_weights(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, response_mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance sampling (TIS) weights ``[B, T]``: ``min(pi_old(y_t) /
    pi_sampler(y_t), cap)`` per response token, 0 where masked, without a graph.

    When the tokens are drawn by another implementation than the one the update differentiates
    (vLLM's kernels against the trainer's), the policy-gradient term's expectation is over the
    sampler's distribution; weighting each token's loss by the ratio of the trainer's to the
    sampler's probability corrects it, and truncating the ratio at ``cap`` bounds its variance
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    eq. 3; Ionides 2008, "Truncated importance sampling").

    Args:
        trainer_logprobs: ``[B, T]`` the rollout policy's log-probabilities as the trainer
            rescored them (``ppo.old_logprobs=rescore``).
        sampler_logprobs: ``[B, T]`` the same tokens' log-probabilities as the sampler drew them.
        response_mask: ``[B, T]`` the response tokens.
        cap: the truncation ``C >= 1``.
    """
    ratio = torch.exp((trainer_logprobs - sampler_logprobs).detach().float()).clamp(max=cap)
    return torch.where(response_mask.bool(), ratio, torch.zeros_like(ratio))


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate policy loss per token.

    Args:
        logprobs: ``[B, T]`` log-probabilities of the taken tokens under the current policy.
        old_logprobs: ``[B, T]`` the same under the policy that sampled them.
        advantages: ``[B, T]`` (whitened) advantages.
        response_mask: ``[B, T]`` True on tokens that count.
        clip_eps: lower clip range, ``rho >= 1 - clip_eps``.
        clip_eps_high: upper clip range (``1 + clip_eps_high``); defaults to ``clip_eps``.
        dual_clip: constant ``c > 1`` bounding the loss at ``-A c`` for negative advantages.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = response_mask.bool()
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    # Sanitise first: garbage under the mask must not reach the backward pass (0 * nan = nan).
    log_ratio = select(logprobs, mask) - select(old_logprobs, mask)
    advantages = select(advantages, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    losses = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    ratio_d = ratio.detach()
    return PolicyLossOutput(
        token_losses=select(losses, mask),
        clipfrac=RunningMean.from_masked(was_clipped.to(ratio_d.dtype), mask),
        dual_clipfrac=RunningMean.from_masked(dual_clipped.to(ratio_d.dtype), mask),
        approx_kl=RunningMean.from_masked((ratio_d - 1.0) - log_ratio.detach(), mask),
        ratio=RunningMean.from_masked(ratio_d, mask),
    )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_eps_value: float | None,
) -> ValueLossOutput:
    """Clipped value loss per token: ``0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)``.

    Args:
        values: ``[B, T]`` current value predictions.
        old_values: ``[B, T]`` values at rollout time.
        returns: ``[B, T]`` GAE returns.
        response_mask: ``[B, T]``.
        clip_eps_value: clip range around ``old_values``; ``None`` disables clipping.
    """
    mask = response_mask.bool()
    values = select(values, mask)
    old_values = select(old_values, mask)
    returns = select(returns, mask)
    error = (values - returns) ** 2
    if clip_eps_value is None:
        losses = 0.5 * error
        clipped_larger = torch.zeros_like(mask)
    else:
        values_clipped = old_values + torch.clamp(
            values - old_values, -clip_eps_value, clip_eps_value
        )
        error_clipped = (values_clipped - returns) ** 2
        losses = 0.5 * torch.maximum(error, error_clipped)
        clipped_larger = error_clipped > error
    error_d = error.detach()
    return ValueLossOutput(
        token_losses=select(losses, mask),
        clipfrac=RunningMean.from_masked(clipped_larger.to(error_d.dtype), mask),
        error=RunningMean.from_masked(error_d, mask),
    )


LOSS_AGGREGATIONS = LOSS_AGGREGATION_CATALOG
"""Each loss aggregation mode by its name (``ppo.loss_agg_mode``): a class with two static
methods over a micro-batch, ``count(mask)``, its units (scalar int64), and
``total(losses, mask)``, the sum of its units' losses (``losses`` ``[B, T]``, 0 where masked,
float32 at least). The mini-batch objective is ``sum(total) / sum(count)``."""

loss_aggregation = LOSS_AGGREGATIONS.register
"""``@loss_aggregation("name")`` registers the decorated class as the mode ``name``."""


@loss_aggregation("token-mean")
class _TokenMean:
    """Every valid token is a unit: ``sum_i m_i l_i / sum_i m_i`` over the mini-batch."""

    @staticmethod
    def count(mask: Tensor) -> Tensor:
        return mask.sum(dtype=torch.int64)

    @staticmethod
    def total(losses: Tensor, mask: Tensor) -> Tensor:
        return losses.sum()


def _sequences(mask: Tensor) -> Tensor:
    # an all-masked sequence has no token mean and takes no part
    return mask.any(dim=-1).sum(dtype=torch.int64)


@loss_aggregation("seq-mean-token-mean")
class _SeqMeanTokenMean:
    """Every sequence is a unit, its loss the mean over its valid tokens."""

    count = staticmethod(_sequences)

    @staticmethod
    def total(losses: Tensor, mask: Tensor) -> Tensor:
        tokens_per_seq = mask.sum(dim=-1).clamp(min=1).to(losses.dtype)
        return (losses.sum(dim=-1) / tokens_per_seq).sum()


@loss_aggregation("seq-mean-token-sum")
class _SeqMeanTokenSum:
    """Every sequence is a unit, its loss the sum over its valid tokens."""

    count = staticmethod(_sequences)

    @staticmethod
    def total(losses: Tensor, mask: Tensor) -> Tensor:
        return losses.sum(dim=-1).sum()


def count_units(response_mask: Tensor, mode: LossAggMode = "token-mean") -> Tensor:
    """How many units a ``[B, T]`` mask holds for ``mode``: valid tokens, or sequences with at least
    one valid token (an all-masked sequence has no token mean and takes no part). Scalar int64."""
    return LOSS_AGGREGATIONS[mode].count(response_mask.bool())


def aggregate_loss(
    token_losses: Tensor, response_mask: Tensor, mode: LossAggMode = "token-mean"
) -> LossParts:
    """Reduce ``[B, T]`` token losses to this micro-batch's (sum, count) for ``mode``.

    - ``token-mean``: sum over valid tokens; count = valid tokens.
      The mini-batch objective is ``sum_i m_i l_i / sum_i m_i``.
    - ``seq-mean-token-mean``: sum over sequences of each sequence's token mean; count = sequences.
    - ``seq-mean-token-sum``: sum over sequences of each sequence's token sum; count = sequences.

    Sums are taken in float32 at least, whatever the model's dtype (docs/design.md section 4).
    """
    aggregation = LOSS_AGGREGATIONS[mode]
    mask = response_mask.bool()
    acc_dtype = torch.promote_types(token_losses.dtype, torch.float32)
    losses = select(token_losses.to(acc_dtype), mask)
    return LossParts(aggregation.total(losses, mask), aggregation.count(mask))
