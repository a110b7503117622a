"""Wall-clock seconds of a run's named steps (layer 3), reported as ``perf/<step>_s`` metrics.

The timed code reads as its steps: each is a ``with watch.step("update"):`` block rather than
``perf_counter`` calls interleaved with the work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TypeVar

__all__ = ["TIMINGS", "Stopwatch"]

TIMINGS = "perf/"
"""The group of wall-clock measurements (``perf/rollout_s``, ``perf/tokens_per_s``, ...)."""

_Entered = TypeVar("_Entered")


class Stopwatch:
    """Seconds per named step; a step timed twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def _add(self, name: str, started: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the block as step ``name``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, started)

    @contextlib.contextmanager
    def entering(self, name: str, context: AbstractContextManager[_Entered]) -> Iterator[_Entered]:
        """Enter ``context`` for the block, timing only its entry as step ``name`` (gathering a
        sharded model, say, apart from the work done with it)."""
        started = time.perf_counter()
        with context as entered:
            self._add(name, started)
            yield entered

    def metrics(self) -> dict[str, float]:
        """``{"perf/<step>_s": seconds}`` for each step timed so far."""
        return {f"{TIMINGS}{name}_s": seconds for name, seconds in self.seconds.items()}
