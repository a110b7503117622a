"""The pairwise (Bradley-Terry) loss of a reward model and where a sequence's score is read.

A reward model gives each sequence a scalar ``r``. For a pair of replies to one prompt, the
probability that people prefer the chosen one is modelled as ``sigmoid(r_chosen - r_rejected)``
(Bradley and Terry 1952; Ouyang et al. 2022, "Training language models to follow instructions
with human feedback", eq. 1), so the loss of a pair is

    l = -log sigmoid(r_chosen - r_rejected - margin)

with an optional ``margin`` (Touvron et al. 2023, "Llama 2", eq. 2: a pair people preferred
strongly must be separated by more). The unit of the exactness contract (docs/design.md
section 4) is the pair: a mini-batch's loss is the sum over its pairs divided by the number of
pairs of the whole mini-batch on all ranks, so :func:`pairwise_loss_parts` returns a sum and a
count for :func:`ppo_core.math.accumulation.accumulate_gradients`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ppo_core.math.losses import LossParts
from ppo_core.math.masked import select
from ppo_core.math.running_mean import RunningMean

__all__ = ["last_token_index", "pairwise_loss_parts", "pairwise_stats"]


def last_token_index(attention_mask: Tensor) -> Tensor:
    """The position of each row's last real token. ``[B, L] -> [B]`` (int64).

    Read from the mask, never from token ids: with the pad token equal to EOS, a search for the
    first pad would stop at a reply's own EOS, and with left padding the last real token is the
    last column. A row without a real token gives 0 (the caller masks it out)."""
    length = attention_mask.shape[-1]
    positions = torch.arange(length, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).amax(-1).clamp(min=0)


def pairwise_loss_parts(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    pair_mask: Tensor,
    margin: Tensor | float = 0.0,
) -> LossParts:
    """The Bradley-Terry loss of a micro-batch of pairs, as a sum and a count.

    Args:
        chosen_scores: ``[B]`` scores of the chosen replies.
        rejected_scores: ``[B]`` scores of the rejected replies.
        pair_mask: ``[B]`` bool, True for a pair that counts (False: padding rows, whose scores
            may hold anything, NaN included, and change neither the sum nor its gradient).
        margin: a number, or ``[B]`` per pair.

    Returns:
        ``LossParts(total = sum_i -log sigmoid(r_c - r_r - margin), count = valid pairs)``,
        the total in float32 at least. ``-log sigmoid(x)`` is ``softplus(-x)``, which stays
        finite for any finite ``x``.
    """
    dtype = torch.promote_types(chosen_scores.dtype, torch.float32)
    difference = chosen_scores.to(dtype) - rejected_scores.to(dtype) - margin
    losses = F.softplus(-select(difference, pair_mask))
    total = select(losses, pair_mask).sum()
    return LossParts(total=total, count=pair_mask.sum().to(torch.int64))


def pairwise_stats(
    chosen_scores: Tensor, rejected_scores: Tensor, pair_mask: Tensor
) -> dict[str, RunningMean]:
    """Pair-weighted statistics of a micro-batch: ``accuracy`` (share of pairs whose chosen
    reply scores higher; a tie counts half) and ``margin`` (mean ``r_c - r_r``). ``[B]`` each."""
    with torch.no_grad():
        difference = select(chosen_scores.double() - rejected_scores.double(), pair_mask)
        won = (difference > 0).double() + 0.5 * (difference == 0).double()
        count = pair_mask.sum()
        return {
            "accuracy": RunningMean.from_sum(select(won, pair_mask).sum(), count),
            "margin": RunningMean.from_sum(difference.sum(), count),
        }
