"""ppo_core: exact, micro-batched PPO for causal language models.

Layers (a lower one never imports a higher one; docs/design.md section 2 names each room):

0. ``ppo_core.catalog``: the one mechanism of the open sets, under everything.
1. ``ppo_core.math``: tensors in, tensors out (masked ops, GAE, losses, exact accumulation);
   ``ppo_core.files``: atomic writes, locks, hashes, the artifact files' names.
2. model I/O: ``prompts``, ``feedback``, ``models``, ``base_sources``, ``rewards``,
   ``checkpoints``.
3. composition: ``config``, ``parallel``, ``registry``, ``experience``, ``training``,
   ``preference``, ``evaluation``.

The math layer's public names can be imported from here (``from ppo_core import PPOObjective``);
each loads with its module on first use, so importing the package alone does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each module of ppo_core.math and the public names it defines, listed once.
_MATH_NAMES: dict[str, tuple[str, ...]] = {
    "accumulation": (
        "AccumulationResult",
        "accumulate_gradients",
        "all_reduce_count",
        "backward_scale",
        "data_parallel_world_size",
    ),
    "advantages": (
        "AdvantageInputs",
        "consecutive_groups",
        "dr_grpo_advantages",
        "grpo_advantages",
        "reinforce_pp_advantages",
        "rloo_advantages",
    ),
    "batching": ("check_batch_sizes", "micro_batch_slices", "minibatch_indices"),
    "declarations": ("ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGG_MODES"),
    "gae": ("compute_gae", "whiten_advantages"),
    "kl": (
        "AdaptiveKLController",
        "FixedKLController",
        "kl_penalty",
        "last_valid_index",
        "token_rewards",
    ),
    "losses": (
        "LossParts",
        "PolicyLossOutput",
        "ValueLossOutput",
        "aggregate_loss",
        "count_units",
        "entropy_from_logits",
        "logprobs_from_logits",
        "policy_loss",
        "value_loss",
    ),
    "masked": (
        "masked_count",
        "masked_mean",
        "masked_moments",
        "masked_sum",
        "masked_var",
        "masked_whiten",
    ),
    "objective": ("PPOObjective",),
    "running_mean": ("RunningMean",),
}
_MODULE_OF = {name: module for module, names in _MATH_NAMES.items() for name in names}

__all__ = sorted(_MODULE_OF)
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"ppo_core.math.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
