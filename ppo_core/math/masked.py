"""Masked reductions and whitening.

Mask convention (docs/design.md section 3): ``True`` means the element counts. Masked positions may
hold any value, NaN and inf included; every function selects with ``torch.where`` so that such
values never reach a result (multiplying by a 0/1 mask would turn ``inf * 0`` into NaN).

Formulas follow the minibatching pull request of TRL's PPO trainer (``masked_mean``,
``masked_var``, ``masked_whiten``), with the Bessel correction ``n / (n - 1)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "masked_count",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "select",
]


def select(values: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """Return ``values`` where ``mask`` is True and ``fill`` elsewhere (same shape).

    Used to sanitise inputs before any arithmetic, so that NaN under the mask cannot leak into a
    gradient either (``0 * nan`` in a backward pass is still NaN).
    """
    mask = _as_bool(mask, values)
    return torch.where(
        mask, values, torch.as_tensor(fill, dtype=values.dtype, device=values.device)
    )


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``values`` over the positions where ``mask`` is True.

    Args:
        values: any shape, e.g. ``[B, T]``.
        mask: broadcastable to ``values``; bool or 0/1.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.
    """
    picked = select(values, mask)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_count(mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Number of True positions in ``mask`` (int64), over ``dim`` or everything."""
    mask = mask.bool()
    return mask.sum(dtype=torch.int64) if dim is None else mask.sum(dim=dim, dtype=torch.int64)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """``sum(x m) / sum(m)`` over the valid positions.

    An empty selection gives NaN, as ``torch.mean`` of an empty tensor does; callers that may see
    empty selections (micro-batches, metrics) use :class:`~ppo_core.math.running_mean.RunningMean`,
    which is zero-count safe.
    """
    mask = _as_bool(mask, values)
    count = mask.expand_as(values).sum(dim=dim) if dim is not None else mask.expand_as(values).sum()
    return masked_sum(values, mask, dim) / count.to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid elements of ``values`` (a scalar).

    ``masked_mean((x - mu)^2) * n / (n - 1)`` when ``unbiased`` (Bessel's correction).

    Raises:
        ValueError: when ``unbiased`` and fewer than 2 elements are valid, since the unbiased
            variance is then undefined (``n - 1 = 0``).
    """
    mask = _as_bool(mask, values).expand_as(values)
    count = int(mask.sum().item())
    if unbiased and count < 2:
        raise ValueError(
            f"masked_var needs at least 2 valid elements for the unbiased variance, got {count}; "
            "check the mask (is the batch empty or fully masked?)"
        )
    if count == 0:
        raise ValueError("masked_var got a mask with no valid element")
    mean = masked_mean(values, mask)
    centered = select(values - mean, mask)
    variance = masked_mean(centered * centered, mask)
    if unbiased:
        variance = variance * (count / (count - 1))
    return variance


def masked_moments(
    values: Tensor, mask: Tensor, all_ranks: bool = False, group: ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance of the valid elements, over this process or over all ranks.

    With ``all_ranks`` (and torch.distributed initialised) the moments are those of the valid
    elements of every rank together: two all-reduces in float64, first of the sum and count, then
    of the squared deviations from the global mean (the two-pass form, which does not cancel).

    Raises:
        ValueError: fewer than 2 valid elements in all.
    """
    mask = _as_bool(mask, values).expand_as(values)
    if not (all_ranks and dist.is_available() and dist.is_initialized()):
        return masked_mean(values, mask), masked_var(values, mask)
    picked = select(values, mask).to(torch.float64)
    totals = torch.stack([picked.sum(), mask.sum().to(torch.float64)])
    dist.all_reduce(totals, group=group)
    count = int(totals[1].item())
    if count < 2:
        raise ValueError(
            f"masked_moments needs at least 2 valid elements over all ranks, got {count}"
        )
    mean = totals[0] / totals[1]
    squares = select((values.to(torch.float64) - mean) ** 2, mask).sum()
    dist.all_reduce(squares, group=group)
    variance = squares / (count - 1)
    return mean.to(values.dtype), variance.to(values.dtype)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_ranks: bool = False,
    group: ProcessGroup | None = None,
) -> Tensor:
    """Normalise the valid elements to zero mean and unit (unbiased) variance.

    ``(x - mu) * rsqrt(var + eps)``; with ``shift_mean=False`` the mean is added back, so only the
    scale changes. Masked positions of the result are 0. With ``all_ranks`` the moments are
    those of all data-parallel ranks together (:func:`masked_moments`).

    Args:
        values: any shape, e.g. advantages ``[B, T]``.
        mask: broadcastable to ``values``.
    """
    mask = _as_bool(mask, values)
    mean, variance = masked_moments(values, mask, all_ranks, group)
    whitened = (select(values, mask) - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return select(whitened, mask)


def _as_bool(mask: Tensor, like: Tensor) -> Tensor:
    if mask.dtype != torch.bool:
        mask = mask != 0
    if mask.device != like.device:
        mask = mask.to(like.device)
    return mask
