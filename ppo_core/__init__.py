"""ppo_core: exact, micro-batched PPO for causal language models.

Layers (a lower one never imports a higher one):

1. ``ppo_core.math``: tensors in, tensors out (masked ops, GAE, losses, exact accumulation).
2. model I/O: loading models and rewards, generation, checkpoints, data.
3. composition: typed config, the PPO loop, evaluation.

The math layer's public names are re-exported here, loaded on first use (importing the package
alone does not import torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppo_core.math import __all__ as _math_all

if TYPE_CHECKING:
    from ppo_core.math import *  # noqa: F403

__all__ = list(_math_all)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _math_all:
        import ppo_core.math

        return getattr(ppo_core.math, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
