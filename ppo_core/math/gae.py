"""Generalised advantage estimation over masked responses.

Schulman et al. (2016), "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16, computed backwards over ``t``:

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    returns = A + V

Masked positions are skipped: ``V_{t+1}`` and ``A_{t+1}`` are those of the next *valid* position
of the row, and 0 past the last one (the episode ends there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ppo_core.math.masked import masked_whiten, select

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["compute_gae", "whiten_advantages"]


@torch.no_grad()
def compute_gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Advantages and returns for a rollout batch.

    Args:
        rewards: ``[B, T]`` per-token rewards (see :func:`~ppo_core.math.kl.token_rewards`).
        values: ``[B, T]`` value estimates of the states before each response token.
        response_mask: ``[B, T]`` True on real response tokens.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, each ``[B, T]``, 0 at masked positions.
    """
    mask = response_mask.bool()
    rewards = select(rewards, mask)
    values = select(values, mask)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = select(advantages + values, mask)
    return advantages, returns


@torch.no_grad()
def whiten_advantages(
    advantages: Tensor,
    response_mask: Tensor,
    all_ranks: bool = False,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Whiten advantages once per rollout batch (masked, Bessel-corrected); ``[B, T]`` in and out.

    Whitening per mini-batch instead would give each mini-batch its own scale, which breaks the
    equality between the micro-batched and the full update (docs/design.md section 4); for the same
    reason, under data parallelism the moments are those of the rollout batch of all ranks.
    """
    return masked_whiten(
        advantages, response_mask, shift_mean=True, all_ranks=all_ranks, group=group
    )
