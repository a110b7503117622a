"""Layer 1 of ppo_core: PPO math on tensors. Imports torch only (docs/design.md section 2).

The names below load with their module on first use, so that a process which only checks a
config (``ppo_core.math.choices``) never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_core.math.accumulation import (
        AccumulationResult,
        accumulate_gradients,
        all_reduce_count,
        backward_scale,
        data_parallel_world_size,
    )
    from ppo_core.math.advantages import (
        AdvantageInputs,
        consecutive_groups,
        dr_grpo_advantages,
        grpo_advantages,
        reinforce_pp_advantages,
        rloo_advantages,
    )
    from ppo_core.math.batching import check_batch_sizes, micro_batch_slices, minibatch_indices
    from ppo_core.math.choices import ADVANTAGE_ESTIMATORS
    from ppo_core.math.gae import compute_gae, whiten_advantages
    from ppo_core.math.kl import (
        KL_ESTIMATORS,
        AdaptiveKLController,
        FixedKLController,
        kl_penalty,
        last_valid_index,
        token_rewards,
    )
    from ppo_core.math.losses import (
        LOSS_AGG_MODES,
        LossParts,
        PolicyLossOutput,
        ValueLossOutput,
        aggregate_loss,
        count_units,
        entropy_from_logits,
        logprobs_from_logits,
        policy_loss,
        value_loss,
    )
    from ppo_core.math.masked import (
        masked_count,
        masked_mean,
        masked_moments,
        masked_sum,
        masked_var,
        masked_whiten,
    )
    from ppo_core.math.objective import PPOObjective
    from ppo_core.math.running_mean import RunningMean

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AccumulationResult",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "LossParts",
    "PPOObjective",
    "PolicyLossOutput",
    "RunningMean",
    "ValueLossOutput",
    "accumulate_gradients",
    "aggregate_loss",
    "all_reduce_count",
    "backward_scale",
    "check_batch_sizes",
    "compute_gae",
    "consecutive_groups",
    "count_units",
    "data_parallel_world_size",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "last_valid_index",
    "logprobs_from_logits",
    "masked_count",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "micro_batch_slices",
    "minibatch_indices",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards",
    "value_loss",
    "whiten_advantages",
]

# Where each public name lives; loaded on first use (PEP 562).
_SUBMODULES = (
    "accumulation",
    "advantages",
    "batching",
    "choices",
    "gae",
    "kl",
    "losses",
    "masked",
    "objective",
    "running_mean",
)


def __getattr__(name: str) -> Any:
    if name in __all__:
        for submodule in _SUBMODULES:
            module = importlib.import_module(f"{__name__}.{submodule}")
            if name in getattr(module, "__all__", ()):
                value = getattr(module, name)
                globals()[name] = value
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
