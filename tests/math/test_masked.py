import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import masked_mean, masked_sum, masked_var, masked_whiten
from tests.helpers import examples

NAN, INF = float("nan"), float("inf")


def test_masked_sum_and_mean_hand_computed():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    # valid: 1 + 2 + 3 + 4 = 10 over 4 elements
    assert masked_sum(x, m).item() == 10.0
    assert masked_mean(x, m).item() == 2.5
    # per row: (1 + 2) / 2 = 1.5, (3 + 4) / 2 = 3.5
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 3.5]
    assert masked_sum(x, m, dim=0).tolist() == [4.0, 2.0, 4.0]


def test_masked_var_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0])
    m = torch.tensor([True, True, True, True, False])
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; biased 5/4, unbiased 5/3
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    assert masked_var(x, m).item() == pytest.approx(5.0 / 3.0)


def test_masked_var_needs_two_elements():
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"at least 2 valid elements.*got 1"):
        masked_var(x, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="got 0"):
        masked_var(x, torch.tensor([False, False]))


def test_masked_whiten_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, NAN])
    m = torch.tensor([True, True, True, True, False])
    # (x - 2.5) / sqrt(5/3 + 1e-8); masked position -> 0
    expected = [(v - 2.5) / math.sqrt(5.0 / 3.0 + 1e-8) for v in (1.0, 2.0, 3.0, 4.0)] + [0.0]
    assert masked_whiten(x, m).tolist() == pytest.approx(expected, abs=1e-6)
    # shift_mean=False adds the mean back: only the scale changes
    shifted = masked_whiten(x, m, shift_mean=False)
    assert shifted[:4].tolist() == pytest.approx([e + 2.5 for e in expected[:4]], abs=1e-6)
    assert shifted[4].item() == 0.0


def reference_whiten(values, mask, shift_mean=True):
    """Straightforward loop: collect the valid numbers, then normalise them."""
    flat_v, flat_m = values.flatten().tolist(), mask.flatten().tolist()
    valid = [v for v, keep in zip(flat_v, flat_m, strict=True) if keep]
    n = len(valid)
    mean = sum(valid) / n
    var = sum((v - mean) ** 2 for v in valid) / (n - 1)
    out = []
    for v, keep in zip(flat_v, flat_m, strict=True):
        if not keep:
            out.append(0.0)
            continue
        w = (v - mean) / math.sqrt(var + 1e-8)
        out.append(w + mean if not shift_mean else w)
    return torch.tensor(out, dtype=torch.float64).reshape(values.shape)


@settings(max_examples=examples(60), deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(2, 7),  # at least two elements: the variance needs two valid values
    seed=st.integers(0, 2**31 - 1),
    shift_mean=st.booleans(),
)
def test_masked_whiten_matches_reference_loop(rows, cols, seed, shift_mean):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3 + 1
    m = torch.rand(rows, cols, generator=gen) < 0.6
    if m.sum() < 2:
        m.view(-1)[:2] = True
    got = masked_whiten(x, m, shift_mean=shift_mean)
    torch.testing.assert_close(got, reference_whiten(x, m, shift_mean), rtol=1e-10, atol=1e-10)


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), garbage=st.sampled_from([NAN, INF, -INF, 1e30]))
def test_garbage_under_the_mask_changes_nothing(seed, garbage):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=gen)
    m = torch.rand(4, 6, generator=gen) < 0.5
    m[0, :2] = True  # at least two valid elements
    dirty = torch.where(m, x, garbage)
    assert torch.equal(masked_sum(x, m), masked_sum(dirty, m))
    assert torch.equal(masked_mean(x, m), masked_mean(dirty, m))
    assert torch.equal(masked_var(x, m), masked_var(dirty, m))
    assert torch.equal(masked_whiten(x, m), masked_whiten(dirty, m))
    assert torch.isfinite(masked_whiten(dirty, m)).all()


def test_float_masks_are_accepted():
    x = torch.tensor([1.0, NAN, 3.0])
    assert masked_mean(x, torch.tensor([1.0, 0.0, 1.0])).item() == 2.0
