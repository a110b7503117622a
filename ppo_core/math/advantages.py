"""Advantage estimators: GAE with a critic, and four that take their baseline from the other
samples of the batch instead (no value model).

Every estimator reads one :class:`AdvantageInputs` and returns ``(advantages, returns)``, each
``[B, T]`` and 0 at masked positions; ``returns`` is ``None`` where there is no critic to train.
:data:`ESTIMATORS` (a :class:`ppo_core.catalog.Catalog`) maps each name of
``ppo.advantage_estimator`` to one; an estimator is added by writing its function here under
``@estimator``, and nowhere else: the config's choices, its checks and the ``ppo train --help``
text read the names and needs from this file (:data:`ppo_core.math.declarations.ESTIMATOR_NEEDS`).

Groups: the critic-free estimators compare samples of the same prompt. ``group_ids[i]`` names
the group of row ``i`` (:func:`consecutive_groups` for ``k`` samples per prompt in a row); a
group's statistics are taken over its rows only, so a batch split into micro-batches or ranks
gives the same advantages as long as each group is whole where they are computed (they are
computed once per rollout batch, before any split: docs/design.md section 4).

A response with no valid token still belongs to its group: its score counts in the group's
statistics, and its advantage reaches no token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ppo_core.math.declarations import ADVANTAGE_ESTIMATOR_CATALOG
from ppo_core.math.gae import compute_gae, whiten_advantages
from ppo_core.math.masked import select

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ESTIMATORS",
    "AdvantageInputs",
    "consecutive_groups",
    "dr_grpo_advantages",
    "estimator",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
]


def consecutive_groups(batch_size: int, group_size: int, device=None) -> Tensor:
    """``[B]`` group ids when each prompt's ``group_size`` samples are consecutive rows:
    ``0, ..., 0, 1, ..., 1, ...``."""
    if group_size < 1 or batch_size % group_size:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the batch of {batch_size} rows"
        )
    return torch.arange(batch_size, device=device) // group_size


def _group_sums(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row sum of its group's ``values`` and its group's size, both ``[B]``."""
    ids = group_ids.long()
    count = int(ids.max()) + 1 if len(ids) else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, ids, values)
    sizes = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
        0, ids, torch.ones_like(values)
    )
    return sums[ids], sizes[ids]


def _require_pairs(sizes: Tensor, estimator: str) -> None:
    if len(sizes) and float(sizes.min()) < 2:
        raise ValueError(
            f"{estimator} needs at least 2 samples of each prompt (a group of 1 has no baseline "
            "from the others); set ppo.samples_per_prompt >= 2"
        )


def _on_tokens(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """A ``[B]`` value on every valid token of its row: ``[B, T]``, 0 elsewhere."""
    return select(per_sequence[:, None].expand_as(response_mask), response_mask.bool())


@torch.no_grad()
def grpo_advantages(
    scores: Tensor, group_ids: Tensor, response_mask: Tensor, eps: float = 1e-6
) -> Tensor:
    """Group-normalised scores (GRPO; Shao et al. 2024, "DeepSeekMath", section 4.1.2, outcome
    supervision), the same on every token of a response:

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)

    over the samples ``g`` of the prompt of row ``i``, ``std`` with Bessel's correction.

    Args:
        scores: ``[B]`` sequence scores.
        group_ids: ``[B]`` the group of each row.
        response_mask: ``[B, T]`` True on real response tokens.
        eps: keeps a group whose scores are all equal at advantage 0.

    Raises:
        ValueError: when a group holds fewer than 2 rows.
    """
    sums, sizes = _group_sums(scores, group_ids)
    _require_pairs(sizes, "grpo")
    mean = sums / sizes
    squares, _ = _group_sums((scores - mean) ** 2, group_ids)
    std = (squares / (sizes - 1)).sqrt()
    return _on_tokens((scores - mean) / (std + eps), response_mask)


@torch.no_grad()
def dr_grpo_advantages(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """GRPO without the division by the group's standard deviation (Dr. GRPO; Liu et al. 2025,
    "Understanding R1-Zero-Like Training: A Critical Perspective", section 3.2), the same on
    every token of a response:

        A_i = s_i - mean_g(s)

    The paper pairs it with a loss that is not normalised by each response's length
    (``seq-mean-token-sum``). Args and errors as :func:`grpo_advantages`.
    """
    sums, sizes = _group_sums(scores, group_ids)
    _require_pairs(sizes, "dr_grpo")
    return _on_tokens(scores - sums / sizes, response_mask)


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Leave-one-out baseline (RLOO; Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs", eq. 7), the same on
    every token of a response:

        A_i = s_i - (sum_g(s) - s_i) / (n_g - 1)

    Args and errors as :func:`grpo_advantages`.
    """
    sums, sizes = _group_sums(scores, group_ids)
    _require_pairs(sizes, "rloo")
    return _on_tokens(scores - (sums - scores) / (sizes - 1), response_mask)


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    all_ranks: bool = False,
    group: ProcessGroup | None = None,
) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", eqs. 3-4): the discounted return of each token from the per-token rewards
    (the KL penalty on every token, the score on the last one), normalised over the valid
    tokens of the whole rollout batch (every rank's with ``all_ranks``):

        G_t = sum_{s >= t} gamma^(s - t) r_s,    A = (G - mean(G)) / std(G)

    ``G`` is GAE with no critic (values 0, lambda 1), so it is computed by
    :func:`~ppo_core.math.gae.compute_gae`; the normalisation is
    :func:`~ppo_core.math.gae.whiten_advantages`.

    Args:
        rewards: ``[B, T]`` per-token rewards (:func:`~ppo_core.math.kl.token_rewards`).
        response_mask: ``[B, T]`` True on real response tokens.
        gamma: discount factor.
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)
    return whiten_advantages(returns, response_mask, all_ranks=all_ranks, group=group)


@dataclass(frozen=True)
class AdvantageInputs:
    """What the estimators read; token fields ``[B, T]``, ``scores`` and ``group_ids`` ``[B]``.

    ``scores`` is each response's whole return (its score, minus the KL penalty of its tokens
    when the KL is in the reward), ``rewards`` the same spread over tokens.

    ``values`` is needed by ``gae`` only, ``group_ids`` by ``grpo``, ``dr_grpo`` and ``rloo``
    only.
    """

    scores: Tensor
    rewards: Tensor
    response_mask: Tensor
    gamma: float = 1.0
    lam: float = 0.95
    values: Tensor | None = None
    group_ids: Tensor | None = None
    whiten: bool = True
    all_ranks: bool = False


EstimatorFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]

ESTIMATORS = ADVANTAGE_ESTIMATOR_CATALOG
"""Each estimator by its name (the value of ``ppo.advantage_estimator``), filled by
:func:`estimator` below."""

estimator = ESTIMATORS.register
"""``@estimator("name", critic=..., groups=...)`` registers the decorated function as the advantage
estimator ``name``: ``critic``, it reads the critic's values (a value model is built, run and
trained) and returns the critic's targets; ``groups``, it compares the samples of one prompt
(``ppo.samples_per_prompt >= 2``). The arguments are literals: the config reads them from this
file's text."""


@estimator("gae", critic=True, groups=False)
def _gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    if inputs.values is None:
        raise ValueError("gae needs the critic's values")
    advantages, returns = compute_gae(
        inputs.rewards, inputs.values, inputs.response_mask, inputs.gamma, inputs.lam
    )
    if inputs.whiten:
        advantages = whiten_advantages(advantages, inputs.response_mask, all_ranks=inputs.all_ranks)
    return advantages, returns


def _groups(inputs: AdvantageInputs, name: str) -> Tensor:
    if inputs.group_ids is None:
        raise ValueError(f"{name} needs the group of each row")
    return inputs.group_ids


@estimator("grpo", critic=False, groups=True)
def _grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    return grpo_advantages(inputs.scores, _groups(inputs, "grpo"), inputs.response_mask), None


@estimator("dr_grpo", critic=False, groups=True)
def _dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    groups = _groups(inputs, "dr_grpo")
    return dr_grpo_advantages(inputs.scores, groups, inputs.response_mask), None


@estimator("rloo", critic=False, groups=True)
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    return rloo_advantages(inputs.scores, _groups(inputs, "rloo"), inputs.response_mask), None


@estimator("reinforce_pp", critic=False, groups=False)
def _reinforce_pp(inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    advantages = reinforce_pp_advantages(
        inputs.rewards, inputs.response_mask, inputs.gamma, all_ranks=inputs.all_ranks
    )
    return advantages, None
