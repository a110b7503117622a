"""Exact gradient accumulation over micro-batches and data-parallel ranks.

The mini-batch objective (docs/design.md section 4) is

    L = sum_i m_i l_i / N,   N = sum_i m_i over all micro-batches k and all ranks r.

Each micro-batch contributes ``S_rk = sum_{i in (r, k)} m_i l_i`` (a :class:`LossParts` total).
``N`` is known before any backward pass, because the masks of the whole mini-batch are, so each
micro-batch backpropagates ``S_rk * R / N``: DDP then averages over ``R`` ranks and the summed
gradient is exactly ``grad L``. Dividing each micro-batch by its own count and the sum by the number
of steps (a mean of means) is the bug this module exists to avoid; see Levanter's "Fix grad accum
when using loss_mask" (marin-community/levanter#842) and docs/design.md section 4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ppo_core.math.losses import LossParts
from ppo_core.math.running_mean import RunningMean

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "AccumulationResult",
    "accumulate_gradients",
    "all_reduce_count",
    "backward_scale",
    "data_parallel_world_size",
]

MicroBatch = TypeVar("MicroBatch")
LossFn = Callable[[MicroBatch], tuple[LossParts, Mapping[str, RunningMean]]]


def data_parallel_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def all_reduce_count(local_count: Tensor | int, group: ProcessGroup | None = None) -> Tensor:
    """Sum a unit count over all ranks of ``group``; int64 scalar, identity on one process."""
    count = torch.as_tensor(local_count, dtype=torch.int64).clone()
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            count = count.cuda()
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count.cpu()


def backward_scale(global_count: Tensor | int, world_size: int = 1) -> float:
    """The factor ``R / N`` that each micro-batch's loss sum is multiplied by before backward.

    Zero when the whole mini-batch has no valid unit: the gradient is then exactly zero, and every
    rank still runs its backward passes so DDP's collectives stay matched.
    """
    total = int(global_count)
    return 0.0 if total == 0 else world_size / total


@dataclass
class AccumulationResult:
    """What one accumulated mini-batch produced (gradients are left in ``.grad``)."""

    loss: RunningMean  # this rank's share of L, count-weighted; .all_reduce() gives L itself
    global_count: int  # N
    local_count: int
    stats: dict[str, RunningMean] = field(default_factory=dict)  # merged micro-batch statistics


def accumulate_gradients(
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    count_fn: Callable[[MicroBatch], Tensor | int],
    *,
    group: ProcessGroup | None = None,
    no_sync: Callable[[], AbstractContextManager] | None = None,
) -> AccumulationResult:
    """Backpropagate the exact mini-batch objective, one micro-batch at a time.

    Args:
        micro_batches: this rank's micro-batches of one mini-batch (the same number on every rank).
        loss_fn: maps a micro-batch to its :class:`LossParts` and its statistics; it runs the
            forward pass, so only one micro-batch's activations are alive at a time.
        count_fn: the micro-batch's unit count, computed from its mask alone (no forward pass);
            must agree with ``loss_fn(...).count``.
        group: data-parallel process group (default: the world, when initialised).
        no_sync: e.g. ``ddp_model.no_sync``; entered for all but the last micro-batch so DDP
            all-reduces gradients once per mini-batch.

    The optimizer step is the caller's: exactly one per mini-batch.
    """
    local_count = sum(int(count_fn(mb)) for mb in micro_batches)
    global_count = int(all_reduce_count(local_count, group))
    world_size = data_parallel_world_size(group)
    scale = backward_scale(global_count, world_size)
    loss = RunningMean.zero()
    stats: dict[str, RunningMean] = {}
    for is_last, micro_batch in _mark_last(micro_batches):
        context = no_sync() if (no_sync is not None and not is_last) else nullcontext()
        with context:
            parts, micro_stats = loss_fn(micro_batch)
            (parts.total * scale).backward()
        loss = loss.merge(RunningMean.from_sum(parts.total.detach(), parts.count))
        for name, value in micro_stats.items():
            stats[name] = stats[name].merge(value) if name in stats else value
    if int(loss.count) != local_count:
        raise RuntimeError(
            f"count_fn counted {local_count} units but loss_fn reported {int(loss.count)}; "
            "they must use the same mask and aggregation mode"
        )
    return AccumulationResult(
        loss=loss, global_count=global_count, local_count=local_count, stats=stats
    )


def _mark_last(items: Sequence[MicroBatch]) -> Iterator[tuple[bool, MicroBatch]]:
    last = len(items) - 1
    for index, item in enumerate(items):
        yield index == last, item
