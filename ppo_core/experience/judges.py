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
from ppo_core.rewards.combined import WeightedReward, term_names
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
    with_terms: bool = False,
) -> RewardFn:
    """The reward named by ``model.reward`` (built-in, user function, reward-model folder, or a
    reward version ``reward:current`` / ``reward:rNNNN`` of ``versions_dir``, its scores
    standardised by the statistics the version recorded), each call limited to
    ``model.reward_timeout`` seconds; errors name the spec as ``key``. A reward module is never
    imported from the folders ``code_free`` (:func:`ppo_core.config.code_free_folders`). A
    reward may take the rows' ``reference_fields`` as keywords. ``with_terms`` (training) adds
    ``model.reward_terms`` weighed by ``model.reward_weights``
    (:class:`~ppo_core.rewards.combined.WeightedReward`); evaluation judges without them."""
    if model.reward_timeout < 0:
        raise ConfigError(
            f"model.reward_timeout must be >= 0 (0: no limit), got {model.reward_timeout}"
        )

    def one(spec: str, spec_key: str) -> RewardFn:
        version = resolve_reward_spec(spec, versions_dir, spec_key)
        return build_reward_fn(
            str(version.folder) if version else spec,
            device=device,
            trust_remote_code=model.trust_remote_code,
            timeout=model.reward_timeout,
            key=spec_key,
            code_free=code_free,
            normalization=(version.score_mean, version.score_std) if version else None,
            name=version.spec if version else None,
            reference_fields=reference_fields,
        )

    primary = one(model.reward, key)
    if not with_terms or not (model.reward_terms or model.reward_weights):
        return primary
    specs = [model.reward, *model.reward_terms]
    rewards = [primary] + [
        one(spec, f"model.reward_terms[{index}]") for index, spec in enumerate(model.reward_terms)
    ]
    weights = list(model.reward_weights) or [1.0] * len(specs)
    return WeightedReward(rewards, weights, term_names(specs))


def with_resolved_reward(config: Config) -> Config:
    """``config`` with ``model.reward=reward:current`` (and any such term of
    ``model.reward_terms``) replaced by the version it names now (``reward:r0002``), so that a
    run, its checkpoints and its candidate record the reward version it trained on, not one
    that may change under it."""
    versions_dir = config.reward_model.versions_dir

    def pinned(spec: str, key: str) -> str:
        version = resolve_reward_spec(spec, versions_dir, key)
        return spec if version is None else version.spec

    reward = pinned(config.model.reward, "model.reward")
    terms = [
        pinned(spec, f"model.reward_terms[{index}]")
        for index, spec in enumerate(config.model.reward_terms)
    ]
    if reward == config.model.reward and terms == list(config.model.reward_terms):
        return config
    return replace(config, model=replace(config.model, reward=reward, reward_terms=terms))
