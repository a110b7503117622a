"""A numerically careful running mean, mergeable across micro-batches, mini-batches and ranks.

Keeps the mean and the count instead of the sum and the count, as in Levanter's ``RunningMean``
(Levanter's "Fix grad accum when using loss_mask", marin-community/levanter#842): adding many values near the same
magnitude to a large sum loses low-order bits, the mean stays in range. Two running means merge
with Chan et al.'s pairwise update ``mean += (x - mean) * n_x / (n + n_x)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RunningMean"]

_ACC_DTYPE = torch.float64


def _scalar(value: Tensor | float | int, device: torch.device | str | None = None) -> Tensor:
    tensor = torch.as_tensor(value, dtype=_ACC_DTYPE, device=device)
    if tensor.dim() != 0:
        raise ValueError(f"RunningMean takes scalars, got a tensor of shape {tuple(tensor.shape)}")
    return tensor.detach()


@dataclass(frozen=True)
class RunningMean:
    """A weighted mean and the total weight behind it (both float64, 0-dim, detached).

    A zero count means "no data"; its mean is 0 and merging with it changes nothing. All
    operations stay on the tensors' device, so accumulating on a GPU costs no host sync until
    :meth:`item` is called.
    """

    mean: Tensor
    count: Tensor

    @classmethod
    def zero(cls, device: torch.device | str | None = None) -> RunningMean:
        return cls(_scalar(0.0, device), _scalar(0.0, device))

    @classmethod
    def of(cls, mean: Tensor | float, count: Tensor | float | int) -> RunningMean:
        """A running mean holding ``count`` units whose mean is ``mean``."""
        device = mean.device if isinstance(mean, Tensor) else None
        count_t = _scalar(count, device)
        mean_t = _scalar(mean, device)
        # An empty selection has an undefined (NaN) mean; store 0 so merges stay finite.
        mean_t = torch.where(count_t > 0, mean_t, torch.zeros_like(mean_t))
        return cls(mean_t, count_t)

    @classmethod
    def from_sum(cls, total: Tensor | float, count: Tensor | float | int) -> RunningMean:
        """Build from a sum and a count; a zero count gives the empty running mean."""
        device = total.device if isinstance(total, Tensor) else None
        total_t = _scalar(total, device)
        count_t = _scalar(count, device)
        safe = torch.where(count_t > 0, count_t, torch.ones_like(count_t))
        mean = torch.where(count_t > 0, total_t / safe, torch.zeros_like(total_t))
        return cls(mean, count_t)

    @classmethod
    def from_masked(cls, values: Tensor, mask: Tensor) -> RunningMean:
        """The mean of the valid elements of ``values`` (any shape) and how many there are."""
        mask = mask.bool().expand_as(values)
        picked = torch.where(mask, values.detach().to(_ACC_DTYPE), 0.0)
        return cls.from_sum(picked.sum(), mask.sum())

    def merge(self, other: RunningMean) -> RunningMean:
        """Chan's pairwise update; exact for weighted means, zero-count safe on either side."""
        other_mean = other.mean.to(self.mean.device)
        other_count = other.count.to(self.count.device)
        total = self.count + other_count
        safe = torch.where(total > 0, total, torch.ones_like(total))
        delta = other_mean - self.mean
        mean = torch.where(total > 0, self.mean + delta * other_count / safe, self.mean)
        return RunningMean(mean, total)

    __add__ = merge

    def add(self, value: Tensor | float, count: Tensor | float | int = 1) -> RunningMean:
        """Merge in ``count`` units whose mean is ``value``."""
        return self.merge(RunningMean.of(value, count))

    def all_reduce(self, group: ProcessGroup | None = None) -> RunningMean:
        """Merge this running mean over all ranks of ``group`` (identity without a process group).

        Reduces ``mean * count`` and ``count`` in float64; the sum form is fine here because it
        happens once per reduction, not once per element.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self
        packed = torch.stack([self.mean * self.count, self.count])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        return RunningMean.from_sum(packed[0], packed[1])

    def item(self) -> float:
        """The mean as a Python float (NaN when empty, so an empty metric is visible as such)."""
        return float(self.mean.item()) if float(self.count.item()) > 0 else float("nan")

    def __repr__(self) -> str:
        return f"RunningMean(mean={float(self.mean):.6g}, count={float(self.count):.6g})"
