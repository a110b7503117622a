import pytest
import torch

from ppo_core import check_batch_sizes, micro_batch_slices, minibatch_indices


def test_minibatches_cover_every_row_once_and_are_seeded():
    a = minibatch_indices(12, 4, torch.Generator().manual_seed(3))
    b = minibatch_indices(12, 4, torch.Generator().manual_seed(3))
    c = minibatch_indices(12, 4, torch.Generator().manual_seed(4))
    assert [len(x) for x in a] == [4, 4, 4]
    assert sorted(torch.cat(a).tolist()) == list(range(12))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_uneven_split_is_an_error_naming_both_sizes():
    with pytest.raises(ValueError, match=r"mini_batch_size=4 does not divide the batch of 10 rows"):
        minibatch_indices(10, 4)


def test_drop_last_warns_with_the_count():
    with pytest.warns(UserWarning, match="dropping 2 of 10 rollout rows"):
        batches = minibatch_indices(10, 4, torch.Generator().manual_seed(0), drop_last=True)
    assert [len(x) for x in batches] == [4, 4]
    assert len(set(torch.cat(batches).tolist())) == 8


def test_micro_batch_slices():
    assert micro_batch_slices(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batch_slices(4, 4) == [slice(0, 4)]
    with pytest.raises(ValueError):
        micro_batch_slices(4, 0)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((64, 128, 8), r"mini_batch_size=128 is larger than rollout_batch_size=64"),
        ((64, 16, 32), r"micro_batch_size=32 is larger than mini_batch_size=16"),
        ((64, 16, 6), r"micro_batch_size=6 does not divide mini_batch_size=16.*e\.g\. 4"),
        ((60, 16, 4), r"mini_batch_size=16 does not divide rollout_batch_size=60 \(12 rows"),
        ((64, 0, 4), r"mini_batch_size must be a positive integer, got 0"),
    ],
)
def test_check_batch_sizes_names_the_values(sizes, message):
    with pytest.raises(ValueError, match=message):
        check_batch_sizes(*sizes)


def test_check_batch_sizes_accepts_nested_sizes():
    check_batch_sizes(64, 16, 4)
    check_batch_sizes(60, 16, 4, drop_last=True)
