import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import RunningMean
from tests.helpers import examples


def test_hand_computed_merge():
    # {1, 2} has mean 1.5 (n=2); {6} has mean 6 (n=1); together (1 + 2 + 6) / 3 = 3
    merged = RunningMean.of(1.5, 2).merge(RunningMean.of(6.0, 1))
    assert merged.item() == pytest.approx(3.0)
    assert float(merged.count) == 3.0
    # Chan's step: 1.5 + (6 - 1.5) * 1 / 3 = 3


def test_zero_count_is_neutral_on_either_side():
    a = RunningMean.of(4.0, 5)
    empty = RunningMean.zero()
    assert (a + empty).item() == 4.0
    assert (empty + a).item() == 4.0
    assert float((empty + empty).count) == 0.0
    assert torch.isfinite((empty + empty).mean)
    # an empty selection's NaN mean is not stored
    assert RunningMean.of(float("nan"), 0).mean.item() == 0.0
    assert RunningMean.from_sum(0.0, 0).mean.item() == 0.0


def test_empty_item_is_nan():
    assert RunningMean.zero().item() != RunningMean.zero().item()  # NaN


def test_from_masked_ignores_garbage():
    x = torch.tensor([2.0, float("nan"), 4.0])
    mask = torch.tensor([True, False, True])
    rm = RunningMean.from_masked(x, mask)
    assert rm.item() == 3.0 and float(rm.count) == 2.0


@settings(max_examples=examples(100), deadline=None)
@given(
    chunks=st.lists(
        st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=0, max_size=6),
        min_size=1,
        max_size=8,
    )
)
def test_merging_chunks_equals_the_mean_of_everything(chunks):
    total = RunningMean.zero()
    for chunk in chunks:
        total = total + RunningMean.from_sum(sum(chunk), len(chunk))
    values = [v for chunk in chunks for v in chunk]
    if not values:
        assert float(total.count) == 0
        return
    assert float(total.count) == len(values)
    assert total.item() == pytest.approx(sum(values) / len(values), rel=1e-9, abs=1e-6)


def test_precision_with_many_similar_values():
    # float32 running sum of 1e6 values near ln(50257) loses digits; the running mean does not.
    value = 10.82
    rm = RunningMean.zero()
    for _ in range(1000):
        rm = rm.add(torch.tensor(value, dtype=torch.float32), 1000)
    assert rm.item() == pytest.approx(float(torch.tensor(value, dtype=torch.float32)), rel=1e-12)
    assert float(rm.count) == 1e6


def test_rejects_non_scalars():
    with pytest.raises(ValueError, match="scalars"):
        RunningMean.of(torch.ones(2), 1)
