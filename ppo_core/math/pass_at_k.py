"""pass@k (layer 1): the chance that at least one of ``k`` replies drawn without replacement
from ``n`` sampled replies, ``c`` of them correct, is correct.

The unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on
Code", eq. 1: ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product
``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (their numerically stable form), averaged over
problems. Imports nothing from torch: counts in, floats out.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["mean_pass_at_k", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` replies, ``c`` correct (``0 <= c <= n``,
    ``1 <= k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct reply
    missed = 1.0
    for i in range(n - c + 1, n + 1):
        missed *= 1.0 - k / i
    return 1.0 - missed


def mean_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, ``correct[j]`` of the ``n`` replies to problem ``j``
    being correct."""
    if not correct:
        raise ValueError("pass@k of no problem")
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)
