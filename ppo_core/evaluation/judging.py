"""The rewards evaluation scores with (layer 3): the evaluation reward built with the rows'
reference fields, the reward version before it, the gate's independent check reward, and the
held-out rows' reference fields."""

from __future__ import annotations

from dataclasses import replace

from ppo_core.config import Config, code_free_folders
from ppo_core.experience.judges import build_reward
from ppo_core.parallel.runtime import Runtime
from ppo_core.references import Reference, load_references
from ppo_core.registry.rewards import REWARD_SPEC_PREFIX, resolve_reward_spec
from ppo_core.rewards.loading import RewardError, RewardFn

__all__ = ["check_reward_fn", "eval_references", "evaluation_rewards", "previous_reward_version"]


def eval_references(config: Config, count: int) -> list[Reference] | None:
    """The first ``count`` held-out rows' reference fields, None when none are declared."""
    if not config.data.reference_fields:
        return None
    return load_references(
        config.data.eval_file,
        config.data.reference_fields,
        max_rows=config.data.max_rows_per_file,
        max_bytes=config.data.max_bytes_per_file,
    )[:count]


def evaluation_rewards(config: Config, reward, runtime: Runtime):
    """The reward both sides are scored with (``reward``, from :func:`~ppo_core.evaluation.evaluate.evaluation_reward`), the
    reward version before it (its spec, or None) and that version's reward function."""
    try:
        reward_fn = build_reward(
            replace(config.model, reward=reward.spec),
            runtime.device,
            code_free=code_free_folders(config),
            versions_dir=config.reward_model.versions_dir,
            reference_fields=config.data.reference_fields,
        )
    except RewardError as exc:
        if reward.source == "model.reward":
            raise
        # The message names model.reward; say where this spec really came from.
        raise RewardError(f"{exc} (the reward set by eval.reward)") from None
    previous = previous_reward_version(config, reward.spec)
    previous_fn = (
        build_reward(
            replace(config.model, reward=previous),
            runtime.device,
            key="the previous reward version",
            versions_dir=config.reward_model.versions_dir,
            reference_fields=config.data.reference_fields,
        )
        if previous
        else None
    )
    return reward_fn, previous, previous_fn


def previous_reward_version(config: Config, spec: str) -> str | None:
    """The reward version before the one ``spec`` names (its ``parent`` in the reward
    registry), as a spec ``reward:rNNNN``; None for a reward that is not a version, or the
    first version. Evaluation scores both models with it too, so that a candidate that wins
    only on a new reward model is seen to (docs/design.md section 3, "Reward versions")."""
    version = resolve_reward_spec(spec, config.reward_model.versions_dir, "model.reward")
    parent = version.entry.get("parent") if version else None
    return f"{REWARD_SPEC_PREFIX}{parent}" if isinstance(parent, str) else None


def check_reward_fn(config: Config, runtime: Runtime) -> RewardFn | None:
    """The gate's independent scorer (``promote.check_reward``), or None when it is off."""
    if config.promote.check_reward is None:
        return None
    spec = replace(config.model, reward=config.promote.check_reward)
    return build_reward(
        spec,
        runtime.device,
        key="promote.check_reward",
        code_free=code_free_folders(config),
        versions_dir=config.reward_model.versions_dir,
        reference_fields=config.data.reference_fields,
    )
