import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core import check_batch_sizes, micro_batch_slices, minibatch_indices
from ppo_core.math.batching import token_budget_slices
from tests.helpers import examples


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


def test_token_budget_slices_by_hand():
    """Rows (prompt, response): (2, 1) (3, 1) (1, 2) (2, 4) (9, 9). Budget 10: rows 0-1 pad
    to 2 x (3 + 1) = 8; adding row 2 gives 3 x (3 + 2) = 15; rows 2-3 pad to 2 x (2 + 4) = 12,
    so row 2 goes with nothing; row 3 alone is 6; row 4 alone is 18, over the budget but
    alone."""
    prompts = torch.tensor([2, 3, 1, 2, 9])
    responses = torch.tensor([1, 1, 2, 4, 9])
    assert token_budget_slices(prompts, responses, 10) == [
        slice(0, 2),
        slice(2, 3),
        slice(3, 4),
        slice(4, 5),
    ]
    assert token_budget_slices(prompts, responses, 15) == [slice(0, 3), slice(3, 4), slice(4, 5)]
    assert token_budget_slices(prompts, responses, 90) == [slice(0, 5)]
    assert token_budget_slices(prompts[:0], responses[:0], 10) == []
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1, got 0"):
        token_budget_slices(prompts, responses, 0)


@settings(max_examples=examples(100), deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=30),
    budget=st.integers(1, 200),
)
def test_token_budget_slices_cover_the_rows_in_order_within_the_budget(lengths, budget):
    """Consecutive, every row once, each slice within the budget or a single row, and no two
    neighbours that would have fit together (the cut is greedy)."""
    prompts = torch.tensor([p for p, _ in lengths], dtype=torch.long)
    responses = torch.tensor([r for _, r in lengths], dtype=torch.long)
    slices = token_budget_slices(prompts, responses, budget)

    def padded(piece: slice) -> int:
        return (piece.stop - piece.start) * int(prompts[piece].max() + responses[piece].max())

    assert [row for piece in slices for row in range(piece.start, piece.stop)] == list(
        range(len(lengths))
    )
    for piece in slices:
        assert piece.stop > piece.start
        assert padded(piece) <= budget or piece.stop - piece.start == 1
    for piece in slices[:-1]:
        assert padded(slice(piece.start, piece.stop + 1)) > budget


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
