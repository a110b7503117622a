"""One iteration's experience and how the update cuts it (layer 3): :class:`RolloutBatch`, its
mini-batches over the data-parallel ranks and its micro-batches.

The index arithmetic (shuffled mini-batch rows, micro-batch slices, the order by length, the
columns that are padding in every row) is tensor math in :mod:`ppo_core.math.batching`; this
module applies it to a batch. The plan keeps the update exact (docs/design.md section 4): a
mini-batch's gradient is a sum over its rows, whatever micro-batch or rank holds each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from ppo_core.config import PPOConfig
from ppo_core.math.batching import (
    by_length,
    kept_columns,
    micro_batch_slices,
    minibatch_indices,
    token_budget_slices,
)
from ppo_core.parallel.process_group import DataParallel

__all__ = [
    "RolloutBatch",
    "all_masked",
    "cut_micro_batches",
    "epochs_of_mini_batches",
    "rows_of_this_rank",
]


@dataclass
class RolloutBatch:
    """One iteration's experience. Token fields are ``[B, T]``, ``scores`` is ``[B]``;
    ``old_values`` and ``returns`` are ``None`` without a critic."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] real response tokens, first EOS included
    old_logprobs: Tensor  # [B, T] sampling policy
    ref_logprobs: Tensor  # [B, T] frozen reference
    old_values: Tensor | None  # [B, T] critic at rollout time
    scores: Tensor  # [B] sequence scores (after the missing-EOS penalty)
    rewards: Tensor  # [B, T] -beta * kl (unless in the loss) + score on the last token
    advantages: Tensor  # [B, T] computed once per rollout batch
    returns: Tensor | None  # [B, T] the critic's targets
    importance_weights: Tensor | None = None  # [B, T] TIS weights of the sampler's draws

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def rows(self, index: Tensor | slice) -> RolloutBatch:
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = None if value is None else value[index]
        return RolloutBatch(**values)

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every row: left prompt padding
        and response positions after the longest response (at least one column is kept).

        Exact (:func:`~ppo_core.math.batching.kept_columns`); the loss sums over masked tokens
        only. A micro-batch of short responses then costs what its tokens cost.
        """
        first, end = kept_columns(self.prompt_mask, self.response_mask)
        if first == 0 and end == self.response_ids.shape[1]:
            return self
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                pass
            elif f.name.startswith("prompt_"):
                value = value[:, first:]
            elif value.dim() == 2:
                value = value[:, :end]
            values[f.name] = value
        return RolloutBatch(**values)


def epochs_of_mini_batches(
    rows: int, ppo: PPOConfig, world_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """The global rows of each mini-batch of ``ppo.epochs`` epochs, each epoch a new shuffle
    drawn from ``generator`` when it starts (so an early stop draws no further shuffle)."""
    for _epoch in range(ppo.epochs):
        yield from minibatch_indices(
            rows, ppo.mini_batch_size * world_size, generator, drop_last=ppo.drop_last
        )


def cut_micro_batches(
    mini_batch: RolloutBatch,
    indices: torch.Tensor,
    rows_per_rank: int,
    parallel: DataParallel,
    ppo: PPOConfig,
) -> list[RolloutBatch]:
    """This rank's rows of a global mini-batch (``indices``) in micro-batches of
    ``ppo.micro_batch_size`` rows, or of ``ppo.micro_batch_tokens`` padded tokens
    (:func:`~ppo_core.math.batching.token_budget_slices`), cut in order of length
    (:func:`~ppo_core.math.batching.by_length`: the mini-batch's gradient is a sum over its rows,
    whatever micro-batch holds each) and each trimmed to its longest prompt and response, plus
    all-masked ones up to the count of the rank cutting the most.

    Every rank runs as many micro-batches as that rank: a sharded model (FSDP) gathers
    parameters for each forward pass and reduces gradients after each backward pass,
    collectives every rank must join. The extra ones add exactly zero. By rows, every rank
    knows that count from ``indices``; by tokens it depends on the lengths each rank holds, so
    the ranks agree on it (an all-reduce of one integer)."""
    order = by_length(mini_batch.prompt_mask, mini_batch.response_mask)
    if ppo.micro_batch_tokens is None:
        slices = micro_batch_slices(len(mini_batch), ppo.micro_batch_size)
        held = torch.bincount(indices // rows_per_rank, minlength=parallel.world_size)
        most = -(-int(held.max()) // ppo.micro_batch_size)
    else:
        slices = token_budget_slices(
            mini_batch.prompt_mask[order].sum(dim=1),
            mini_batch.response_mask[order].sum(dim=1),
            ppo.micro_batch_tokens,
        )
        most = parallel.most(len(slices))
    cut = [mini_batch.rows(order[rows]).trimmed() for rows in slices]
    while len(cut) < most:
        cut.append(all_masked(cut[0]))
    return cut


def rows_of_this_rank(batch: RolloutBatch, global_indices: torch.Tensor, rank: int) -> RolloutBatch:
    """The rows of a global mini-batch that this rank holds; an all-masked row when it holds
    none, so that its backward pass (and DDP's all-reduce) still happens with zero weight."""
    first_row = rank * len(batch)
    held = (global_indices >= first_row) & (global_indices < first_row + len(batch))
    local = global_indices[held] - first_row
    if len(local) == 0:
        return all_masked(batch)
    return batch.rows(local.to(batch.response_ids.device))


def all_masked(batch: RolloutBatch) -> RolloutBatch:
    """The first row of ``batch`` with every response token masked: it counts no unit and adds
    zero to every gradient, but its passes join the collectives of the others."""
    empty = batch.rows(slice(0, 1))
    empty.response_mask = torch.zeros_like(empty.response_mask)
    return empty
