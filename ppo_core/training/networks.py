"""Step 4 of the run (layer 3): the networks (policy with value head, or LoRA adapters on a
frozen base, the reference, the data-parallel wrapping); the optimizer and the learning-rate
schedule are in :mod:`ppo_core.training.optimizer`. The reference and the reward come from :mod:`ppo_core.experience.judges`, where
evaluation builds its own, so both judge with the same ones."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_core.config import Config
from ppo_core.experience.judges import load_reference
from ppo_core.models.causal_lm import checkpoint_blocks
from ppo_core.models.lora import LoraSettings, LoraWeights
from ppo_core.models.policy import ActorCritic, load_actor_critic
from ppo_core.models.weights import FullWeights, PolicyWeights
from ppo_core.parallel.runtime import Runtime
from ppo_core.parallel.strategies import ParallelStrategy


@dataclass
class Models:
    """The networks of a run."""

    actor_critic: ActorCritic
    """The policy with its value head: what is trained, checkpointed and saved."""
    update_model: torch.nn.Module
    """``actor_critic``, wrapped in DDP under data parallelism, for the update's passes."""
    reference: torch.nn.Module
    """The frozen KL reference."""
    strategy: ParallelStrategy
    """How the models are spread over the ranks (``parallel.strategy``)."""


def build_models(
    config: Config, runtime: Runtime, strategy: ParallelStrategy, checkpoint: Path | None
) -> Models:
    """The actor-critic from ``checkpoint`` (a checkpoint's model folder) or, starting afresh,
    from ``model.policy`` (and ``model.lora.adapter``), and the reference, spread over the
    ranks by ``strategy``.

    With LoRA (``model.lora.enabled``) the policy is ``model.policy`` with an adapter: the
    checkpoint's, else ``model.lora.adapter``, else a fresh one; and unless ``model.reference``
    names a folder, the reference is the same weights with the trained adapter off (or with a
    frozen copy of ``model.lora.adapter`` in its place)."""
    torch.manual_seed(config.seed)
    model = config.model
    weights = policy_weights(config)
    start_folder = checkpoint or model.lora.adapter or model.policy
    actor_critic = strategy.load(
        lambda: load_actor_critic(
            start_folder, model.critic, model.trust_remote_code, weights=weights
        )
    )
    if config.train.gradient_checkpointing:
        checkpoint_blocks(actor_critic)
    reference = actor_critic.shared_reference() if model.reference is None else None
    if reference is None:
        reference = strategy.wrap_reference(strategy.load(lambda: load_reference(model, None)))
    return Models(
        actor_critic=actor_critic,
        update_model=strategy.wrap(actor_critic),
        reference=reference,
        strategy=strategy,
    )


def policy_weights(config: Config) -> PolicyWeights:
    """Which of the policy's weights the run trains: a LoRA adapter on ``model.policy`` with
    ``model.lora.enabled``, else every weight."""
    lora = config.model.lora
    if not lora.enabled:
        return FullWeights()
    settings = LoraSettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
    )
    return LoraWeights(settings, config.model.policy, lora.adapter)
