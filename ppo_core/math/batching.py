"""Mini-batch and micro-batch index plans for the PPO update.

Each PPO epoch shuffles the rollout batch (seeded) and splits it into mini-batches, one optimizer
step each; each mini-batch is split into micro-batches whose gradients are accumulated
(:mod:`ppo_core.math.accumulation`). A split that does not divide the batch is an error naming both
sizes, unless the caller asked to drop the remainder, in which case a warning says how many rows
were dropped (the ``drop_last`` discussion of TRL's "add minibatching", huggingface/trl#153).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ppo_core.math.declarations import check_batch_sizes

__all__ = [
    "by_length",
    "check_batch_sizes",
    "kept_columns",
    "micro_batch_slices",
    "minibatch_indices",
    "token_budget_slices",
]


def minibatch_indices(
    batch_size: int,
    mini_batch_size: int,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
    shuffle: bool = True,
) -> list[Tensor]:
    """Row indices of each mini-batch for one epoch.

    Args:
        batch_size: rows in the rollout batch.
        mini_batch_size: rows per mini-batch.
        generator: seeded generator for the shuffle (reproducible epochs).
        drop_last: drop the rows that do not fill a last mini-batch (with a warning) instead of
            raising.
        shuffle: permute rows first.

    Returns:
        A list of int64 index tensors of length ``mini_batch_size`` each.
    """
    if mini_batch_size < 1 or batch_size < 1:
        raise ValueError(
            f"batch_size and mini_batch_size must be >= 1, got {batch_size} and {mini_batch_size}"
        )
    remainder = batch_size % mini_batch_size
    if remainder and not drop_last:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} does not divide the batch of {batch_size} rows "
            f"({remainder} left over); choose a divisor or set drop_last"
        )
    if mini_batch_size > batch_size:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} is larger than the batch of {batch_size} rows"
        )
    if remainder:
        warnings.warn(
            f"dropping {remainder} of {batch_size} rollout rows this epoch: mini_batch_size="
            f"{mini_batch_size} does not divide the batch",
            stacklevel=2,
        )
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    usable = batch_size - remainder
    return list(order[:usable].split(mini_batch_size))


def micro_batch_slices(size: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of at most ``micro_batch_size`` rows covering ``range(size)``.

    The last slice may be shorter; the exact normalisation makes that harmless for the gradient.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        slice(start, min(start + micro_batch_size, size))
        for start in range(0, size, micro_batch_size)
    ]


def token_budget_slices(
    prompt_lengths: Tensor, response_lengths: Tensor, budget: int
) -> list[slice]:
    """Consecutive slices covering the rows, each as many rows as fit in ``budget`` padded
    tokens, at least one (a row longer than the budget goes alone). ``[B], [B] -> slices``.

    A slice trimmed to its own columns (:func:`kept_columns`) is ``rows x (longest prompt +
    longest response)`` tokens wide, padding included; that product is what the budget bounds,
    so a pass over short rows takes many and one over long rows few. Rows should come in
    :func:`by_length` order, so that neighbours pad each other little. Which rows share a pass
    leaves the gradient unchanged (docs/design.md section 4)."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    slices: list[slice] = []
    start, longest_prompt, longest_response = 0, 0, 0
    for row, (prompt, response) in enumerate(
        zip(prompt_lengths.tolist(), response_lengths.tolist(), strict=True)
    ):
        wider_prompt, wider_response = max(longest_prompt, prompt), max(longest_response, response)
        if row > start and (row + 1 - start) * (wider_prompt + wider_response) > budget:
            slices.append(slice(start, row))
            start, wider_prompt, wider_response = row, prompt, response
        longest_prompt, longest_response = wider_prompt, wider_response
    if len(prompt_lengths):
        slices.append(slice(start, len(prompt_lengths)))
    return slices


def by_length(prompt_mask: Tensor, response_mask: Tensor) -> Tensor:
    """Row order, shortest response first (then shortest prompt), so that consecutive rows cut
    into micro-batches carry little padding. ``[B, P], [B, T] -> [B]`` (a permutation)."""
    prompt_lengths = prompt_mask.long().sum(dim=1)
    response_lengths = response_mask.long().sum(dim=1)
    key = response_lengths * (prompt_mask.shape[1] + 1) + prompt_lengths
    return torch.argsort(key, stable=True)


def kept_columns(prompt_mask: Tensor, response_mask: Tensor) -> tuple[int, int]:
    """``(first, end)``: rows ``[B, P]`` / ``[B, T]`` need prompt columns ``first:`` (left
    padding in every row before them) and response columns ``:end`` (after every row's end);
    at least one response column is kept.

    Dropping the others changes no logit: positions come from the attention mask, padded keys
    are masked out, and under causal attention no kept position looks at a later dropped one.
    """
    prompt_cols = prompt_mask.any(dim=0).nonzero()
    response_cols = response_mask.any(dim=0).nonzero()
    first = int(prompt_cols[0]) if len(prompt_cols) else 0
    end = int(response_cols[-1]) + 1 if len(response_cols) else 1
    return first, end
