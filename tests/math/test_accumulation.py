"""The exactness contract (docs/design.md section 4): micro-batched gradients equal the full pass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_core import (
    LOSS_AGG_MODES,
    accumulate_gradients,
    backward_scale,
    count_units,
    micro_batch_slices,
)
from tests.helpers import examples
from tests.math.toy import ToyBatch, ToyPolicy, ppo_micro_loss, random_batch, relative_error


def full_gradient(batch: ToyBatch, mode: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Reference: one forward pass over the whole mini-batch, loss = sum / count."""
    model = ToyPolicy(seed=0, dtype=dtype)
    parts, _ = ppo_micro_loss(model, batch, mode)
    (parts.total / parts.count).backward()
    return [p.grad.clone() for p in model.parameters()]


def accumulated_gradient(batch: ToyBatch, mode: str, micro: int, dtype: torch.dtype):
    model = ToyPolicy(seed=0, dtype=dtype)
    micro_batches = [batch.rows(s) for s in micro_batch_slices(len(batch), micro)]
    result = accumulate_gradients(
        micro_batches,
        loss_fn=lambda mb: ppo_micro_loss(model, mb, mode),
        count_fn=lambda mb: count_units(mb.response_mask, mode),
    )
    return [p.grad.clone() for p in model.parameters()], result


def mean_of_means_gradient(batch: ToyBatch, mode: str, micro: int, dtype: torch.dtype):
    """The common bug: each micro-batch divided by its own count, then by the number of steps."""
    model = ToyPolicy(seed=0, dtype=dtype)
    slices = micro_batch_slices(len(batch), micro)
    for s in slices:
        parts, _ = ppo_micro_loss(model, batch.rows(s), mode)
        (parts.total / parts.count / len(slices)).backward()
    return [p.grad.clone() for p in model.parameters()]


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 10),
    length=st.integers(1, 6),
    p_valid=st.floats(0.05, 1.0),
    mode=st.sampled_from(LOSS_AGG_MODES),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    empty_row=st.integers(0, 9),
)
def test_accumulated_gradient_equals_full_gradient_for_every_micro_batch_size(
    seed, batch, length, p_valid, mode, dtype, empty_row
):
    data = random_batch(seed, batch, length, dtype, p_valid, empty_rows=(empty_row % batch,))
    data.response_mask[(empty_row + 1) % batch, 0] = True  # at least one valid unit
    expected = full_gradient(data, mode, dtype)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for micro in range(1, batch + 1):
        actual, result = accumulated_gradient(data, mode, micro, dtype)
        assert relative_error(actual, expected) <= tolerance, f"micro_batch_size={micro}"
        assert result.global_count == int(count_units(data.response_mask, mode))


def test_mean_of_means_differs_on_the_same_data():
    # Unequal token counts per micro-batch: 5 of 8 rows are mostly masked.
    data = random_batch(seed=7, batch=8, length=6, p_valid=0.9)
    data.response_mask[3:, 1:] = False
    for mode in LOSS_AGG_MODES:
        expected = full_gradient(data, mode, torch.float64)
        exact, _ = accumulated_gradient(data, mode, 3, torch.float64)
        naive = mean_of_means_gradient(data, mode, 3, torch.float64)
        assert relative_error(exact, expected) <= 1e-12
        if mode != "seq-mean-token-mean" and mode != "seq-mean-token-sum":
            assert relative_error(naive, expected) > 1e-3, mode
    # In sequence modes the bug shows with an uneven last micro-batch: 8 rows as 3 + 3 + 2.
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        expected = full_gradient(data, mode, torch.float64)
        naive = mean_of_means_gradient(data, mode, 3, torch.float64)
        assert relative_error(naive, expected) > 1e-3, mode


def test_an_all_masked_micro_batch_works():
    data = random_batch(
        seed=3, batch=4, length=5, p_valid=0.8, empty_rows=(0, 1), garbage=float("nan")
    )
    expected = full_gradient(data, "token-mean", torch.float64)
    actual, result = accumulated_gradient(data, "token-mean", 2, torch.float64)
    assert relative_error(actual, expected) <= 1e-12
    assert all(torch.isfinite(g).all() for g in actual)
    # the mean of means divides 0 by 0 in the empty micro-batch: its loss is NaN
    empty_parts, _ = ppo_micro_loss(ToyPolicy(seed=0), data.rows(slice(0, 2)), "token-mean")
    assert torch.isnan(empty_parts.total / empty_parts.count)
    # the loss reported is the mini-batch loss, count-weighted
    parts, _ = ppo_micro_loss(ToyPolicy(seed=0), data, "token-mean")
    assert result.loss.item() == pytest.approx((parts.total / parts.count).item(), rel=1e-12)


def test_a_mini_batch_with_no_valid_token_gives_a_zero_gradient():
    data = random_batch(seed=3, batch=4, length=5, p_valid=0.0)
    actual, result = accumulated_gradient(data, "token-mean", 2, torch.float64)
    assert result.global_count == 0
    assert all((g == 0).all() for g in actual)
    assert backward_scale(0, 4) == 0.0
    assert backward_scale(10, 2) == pytest.approx(0.2)


def test_stats_are_token_weighted_across_micro_batches():
    data = random_batch(seed=5, batch=6, length=4, p_valid=0.5)
    model = ToyPolicy(seed=0)
    _, full_stats = ppo_micro_loss(model, data, "token-mean")
    _, result = accumulated_gradient(data, "token-mean", 1, torch.float64)
    for name, value in full_stats.items():
        assert result.stats[name].item() == pytest.approx(value.item(), rel=1e-12), name


def test_count_fn_must_agree_with_loss_fn():
    data = random_batch(seed=5, batch=4, length=4)
    model = ToyPolicy(seed=0)
    with pytest.raises(RuntimeError, match="count_fn counted"):
        accumulate_gradients(
            [data],
            loss_fn=lambda mb: ppo_micro_loss(model, mb, "token-mean"),
            count_fn=lambda mb: count_units(mb.response_mask, "seq-mean-token-mean"),
        )
