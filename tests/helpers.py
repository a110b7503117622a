"""Small assertion helpers shared by the tests."""

import torch


def assert_close(actual: torch.Tensor, expected, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Compare a tensor with a (nested) list of expected numbers, printing both on failure."""
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=rtol, atol=atol)
