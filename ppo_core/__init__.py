"""ppo_core: exact, micro-batched PPO for causal language models.

Layers (a lower one never imports a higher one):

1. ``ppo_core.math``: tensors in, tensors out (masked ops, GAE, losses, exact accumulation).
2. model I/O: loading models and rewards, generation, checkpoints, data.
3. composition: typed config, the PPO loop, evaluation.

The math layer's public names are re-exported here.
"""

from ppo_core.math import *  # noqa: F403
from ppo_core.math import __all__ as _math_all

__all__ = list(_math_all)
__version__ = "0.1.0"
