"""Step 5 of the run (layer 3): :class:`TrainState`, everything a checkpoint stores besides the
weights (optimizer, scheduler, KL controller, iteration, history), saved and restored exactly."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_core.checkpoints.store import checked_history, save_checkpoint
from ppo_core.config import Config
from ppo_core.math.kl import AdaptiveKLController, FixedKLController
from ppo_core.models.policy import ActorCritic
from ppo_core.parallel.process_group import DataParallel
from ppo_core.training.networks import Models
from ppo_core.training.optimizer import build_optimizer, build_scheduler
from ppo_core.training.stopwatch import TIMINGS


def without_timings(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without :data:`TIMINGS`. Loggers get every metric, but checkpoints and the
    candidate are DVC outputs, which must hold the same bytes whenever the same inputs are run
    again, so no wall-clock time is written into them."""
    return {name: value for name, value in metrics.items() if not name.startswith(TIMINGS)}


@dataclass
class TrainState:
    """Everything besides the weights that changes during a run: exactly what a checkpoint
    stores and a resume restores."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_controller: FixedKLController | AdaptiveKLController
    iteration: int = 0
    """Iterations completed."""
    history: list[dict[str, float]] = field(default_factory=list)
    """The metrics of every completed iteration, each with its ``iteration`` number."""

    def restore(self, checkpoint: dict[str, Any], models: Models) -> None:
        """Take the state of a checkpoint read by ``load_latest_good``: of a sharded one, the
        weights too (every rank calls it)."""
        if checkpoint["sharded"] is not None:
            # Here, not at the top: it imports DCP (1.6 s), which only a sharded run needs.
            from ppo_core.checkpoints.sharded import load_sharded_checkpoint

            load_sharded_checkpoint(checkpoint["sharded"], models.actor_critic, self.optimizer)
        else:
            models.strategy.load_optimizer_state(
                models.update_model, self.optimizer, checkpoint["optimizer"]
            )
        if checkpoint["scheduler"] is not None:
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        state = checkpoint["state"]
        self.iteration = int(state["iteration"])
        self.kl_controller.value = float(state["kl_coef"])
        self.history = checked_history(state.get("history", []), "checkpoint trainer state")

    def save(
        self,
        config: Config,
        models: Models,
        tokenizer: Any,
        lineage: dict[str, Any],
        parallel: DataParallel,
    ) -> None:
        """Write checkpoint ``step-{iteration}`` atomically with the weights, the optimizer's
        state and ``lineage`` (every rank calls it): sharded, each rank writing its own shards,
        when the strategy shards the model; else whole, written by rank 0."""
        train = config.train
        history = [without_timings(row) for row in self.history]
        state = {"kl_coef": self.kl_controller.value, "history": history, **lineage}
        if models.strategy.sharded:
            from ppo_core.checkpoints.sharded import save_sharded_checkpoint  # as above

            save_sharded_checkpoint(
                train.checkpoint_dir,
                self.iteration,
                models.actor_critic,
                self.optimizer,
                functools.partial(models.actor_critic.describe, tokenizer=tokenizer),
                self.scheduler,
                state,
                keep=train.keep_checkpoints,
            )
        elif parallel.is_main:
            save_checkpoint(
                train.checkpoint_dir,
                self.iteration,
                functools.partial(models.actor_critic.save, tokenizer=tokenizer),
                self.optimizer.state_dict(),
                self.scheduler,
                state,
                keep=train.keep_checkpoints,
            )
        parallel.barrier()  # no rank runs ahead of a checkpoint it may resume from


def build_train_state(config: Config, actor_critic: ActorCritic) -> TrainState:
    """A fresh state: optimizer, learning-rate schedule and KL controller from the config."""
    optimizer = build_optimizer(actor_critic.parameters(), config.optim)
    kl = config.kl
    return TrainState(
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config.optim, config.train.iterations),
        kl_controller=(
            AdaptiveKLController(kl.coef, kl.target, kl.horizon)
            if kl.adaptive
            else FixedKLController(kl.coef)
        ),
    )


# -- the loop -------------------------------------------------------------------------------------
