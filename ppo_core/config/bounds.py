"""Numeric ranges of config keys (layer 3), declared beside each field of the schema with
:func:`bounded` and checked for every key by ``ppo_core.config.checks``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

_V = TypeVar("_V")


@dataclass(frozen=True)
class Bounds:
    """A numeric key's range, declared beside its field (:func:`bounded`) and checked by
    ``validate_config``: ``low`` and ``high`` (each open or closed; None: no limit), and
    ``most``, the largest count or size that is not a slip (a few zeros too many fail naming
    the key instead of allocating for hours or running out of memory in the middle of a run).
    A key that may be null is not checked when it is."""

    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    most: int | None = None
    nullable: bool = False
    """Whether the key may be null (its type says so), which the error message mentions."""
    why: str | None = None
    """Why the range is what it is, where that is not plain (a floor above zero, say): the error
    message gives it after the range."""

    def rule(self) -> str:
        """The range in words: ``> 0``, ``>= 1``, ``in [0, 1]``, ``in (0, 1]``."""
        if self.low is not None and self.high is not None:
            return (
                f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        assert self.high is not None
        return f"{'<' if self.high_open else '<='} {self.high:g}"

    def holds(self, value: float) -> bool:
        """Whether ``value`` lies within ``low`` and ``high`` (``most`` is checked apart)."""
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        high = self.high
        return high is None or not (value > high or (self.high_open and value == high))


def bounded(
    default: _V,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    most: int | None = None,
    why: str | None = None,
) -> _V:
    """A dataclass field with ``default`` and its :class:`Bounds` (``gt``/``ge``: above,
    ``lt``/``le``: below, ``most``: the slip guard of a count, ``why``: the reason for a range
    that is not plain, given in the error)."""
    bounds = Bounds(
        low=gt if gt is not None else ge,
        low_open=gt is not None,
        high=lt if lt is not None else le,
        high_open=lt is not None,
        most=most,
        why=why,
    )
    return field(default=default, metadata={"bounds": bounds})


# The slip guards of counts and sizes: far above any real run. Seeds: torch takes 64-bit ones; a
# larger integer (a flow run's `params`, a YAML file) would overflow in the middle of a run.
MAX_BATCH_ROWS = 1_000_000
MAX_ITERATIONS = 100_000_000
MAX_TOKENS = 1_000_000
MAX_ROWS = 1_000_000_000
MAX_SEED = 2**63 - 1

# The floor of generation.temperature. Below it sampling is greedy already (SmolLM2-135M, 4
# prompts x 24 tokens: the top token's probability is 1.000000 at 1e-3, the smallest gap between
# the top two logits 0.018), so a lower temperature changes no draw and only scales the
# log-probabilities and their gradients by 1/temperature; logits / temperature overflow float32
# (probabilities NaN) only far lower, below about 3.4e38 / max|logit| (1e-37 for SmolLM2's 35.5),
# which the floor keeps out of reach of any realistic logit.
MIN_TEMPERATURE = 1e-3
TEMPERATURE_FLOOR = (
    "sampling is greedy already at 1e-3 (set top_k=1 for greedy), and a far smaller one "
    "overflows logits / temperature to NaN probabilities"
)
