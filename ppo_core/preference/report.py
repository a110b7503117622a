"""What a reward model says about held-out pairs: accuracy, margin, calibration and accuracy
by length bias (layer 3).

- ``accuracy``: share of pairs whose chosen reply scores higher (a tie counts half);
- ``margin``: mean ``r_chosen - r_rejected``;
- ``ece``: expected calibration error of the model's preference probability
  ``p = sigmoid(r_chosen - r_rejected)`` read as a classifier (Guo et al. 2017, "On Calibration
  of Modern Neural Networks", eq. 3): each pair's prediction is the side ``p`` favours, its
  confidence ``max(p, 1 - p)``; pairs fall in ``bins`` equal-width confidence bins over
  ``[0.5, 1]`` and ``ece = sum_b (n_b / n) |accuracy_b - confidence_b|``;
- ``accuracy_chosen_longer`` / ``accuracy_chosen_shorter`` / ``accuracy_same_length``, with
  the pairs each holds: a model that learnt "longer is better" is right on the first and wrong
  on the second.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["expected_calibration_error", "pair_report"]


def expected_calibration_error(margins: Tensor, bins: int = 10) -> float:
    """ECE of ``sigmoid(margins)`` as a preference classifier (module docstring). ``[N]``."""
    if margins.numel() == 0:
        return math.nan
    probability = torch.sigmoid(margins.double())
    confidence = torch.maximum(probability, 1 - probability)
    correct = (margins > 0).double() + 0.5 * (margins == 0).double()
    index = ((confidence - 0.5) * 2 * bins).floor().clamp(0, bins - 1).long()
    error = 0.0
    for b in range(bins):
        members = index == b
        if members.any():
            gap = correct[members].mean() - confidence[members].mean()
            error += float(members.double().mean() * gap.abs())
    return error


def pair_report(
    chosen: Tensor, rejected: Tensor, chosen_lengths: list[int], rejected_lengths: list[int]
) -> dict[str, float]:
    """The held-out metrics of the module docstring from the scores ``[N]`` of each pair's
    chosen and rejected reply and the replies' token counts."""
    margins = chosen.double() - rejected.double()
    won = (margins > 0).double() + 0.5 * (margins == 0).double()
    longer = torch.tensor(chosen_lengths) - torch.tensor(rejected_lengths)
    report = {
        "pairs": float(len(margins)),
        "accuracy": float(won.mean()) if len(won) else math.nan,
        "margin": float(margins.mean()) if len(margins) else math.nan,
        "ece": expected_calibration_error(margins),
    }
    for name, members in (
        ("chosen_longer", longer > 0),
        ("chosen_shorter", longer < 0),
        ("same_length", longer == 0),
    ):
        report[f"pairs_{name}"] = float(members.sum())
        report[f"accuracy_{name}"] = float(won[members].mean()) if members.any() else math.nan
    return report
