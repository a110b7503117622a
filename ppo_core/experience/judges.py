"""The models that judge samples (layer 3): the frozen KL reference and the reward, built once
here for training and for evaluation, so that both judge with the same ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ppo_core.config import Config, ConfigError, ModelConfig
from ppo_core.models.lora import load_trainable_adapter
from ppo_core.models.policy import load_causal_lm
from ppo_core.registry.rewards import resolve_reward_spec
from ppo_core.rewards.loading import RewardFn, build_reward_fn

__all__ = ["build_reward", "load_reference", "with_resolved_reward"]


def load_reference(model: ModelConfig, device: torch.device | None) -> torch.nn.Module:
    """The frozen KL reference loaded from a folder: ``model.reference``, else the starting
    policy (``model.policy`` with ``model.lora.adapter`` merged in when there is one), in
    ``model.reference_dtype``, on ``device`` (None: where it was built, for a strategy to place
    it)."""
    dtype = torch.bfloat16 if model.reference_dtype == "bf16" else torch.float32
    if model.reference is None and model.lora.adapter is not None:
        base = load_causal_lm(model.policy, "model.policy", model.trust_remote_code, dtype)
        reference: torch.nn.Module = load_trainable_adapter(
            base, model.lora.adapter, model.policy, "model.lora.adapter"
        ).merge_and_unload()
    else:
        reference = load_causal_lm(
            model.reference or model.policy, "reference", model.trust_remote_code, dtype
        )
    reference.requires_grad_(False)
    return reference.eval() if device is None else reference.eval().to(device)


def build_reward(
    model: ModelConfig,
    device: torch.device,
    key: str = "model.reward",
    code_free: Sequence[str] = (),
    versions_dir: str = "models/rewards",
    reference_fields: Sequence[str] = (),
) -> RewardFn:
    """The reward named by ``model.reward`` (built-in, user function, reward-model folder, or a
    reward version ``reward:current`` / ``reward:rNNNN`` of ``versions_dir``, its scores
    standardised by the statistics the version recorded), each call limited to
    ``model.reward_timeout`` seconds; errors name the spec as ``key``. A reward module is never
    imported from the folders ``code_free`` (:func:`ppo_core.config.code_free_folders`). A
    reward may take the rows' ``reference_fields`` as keywords."""
    if model.reward_timeout < 0:
        raise ConfigError(
            f"model.reward_timeout must be >= 0 (0: no limit), got {model.reward_timeout}"
        )
    version = resolve_reward_spec(model.reward, versions_dir, key)
    return build_reward_fn(
        str(version.folder) if version else model.reward,
        device=device,
        trust_remote_code=model.trust_remote_code,
        timeout=model.reward_timeout,
        key=key,
        code_free=code_free,
        normalization=(version.score_mean, version.score_std) if version else None,
        name=version.spec if version else None,
        reference_fields=reference_fields,
    )


def with_resolved_reward(config: Config) -> Config:
    """``config`` with ``model.reward=reward:current`` replaced by the version it names now
    (``reward:r0002``), so that a run, its checkpoints and its candidate record the reward
    version it trained on, not one that may change under it."""
    spec = config.model.reward
    version = resolve_reward_spec(spec, config.reward_model.versions_dir, "model.reward")
    if version is None or spec == version.spec:
        return config
    return replace(config, model=replace(config.model, reward=version.spec))
