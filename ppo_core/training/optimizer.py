"""The optimizer over the trainable parameters and its learning-rate schedule (``optim.*``),
built with the run's state (:mod:`ppo_core.training.state`) and rebuilt on resume."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ppo_core.config import OptimConfig

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], optim: OptimConfig
) -> torch.optim.Optimizer:
    params = [p for p in parameters if p.requires_grad]
    if optim.name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=(optim.betas[0], optim.betas[1]),
            eps=optim.eps,
        )
    if optim.name == "sgd":
        return torch.optim.SGD(
            params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
        )
    raise ValueError(f"unknown optimizer {optim.name!r}; choose adamw or sgd")


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_iterations: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``optim.warmup_iterations``, then constant or a linear decay to 0."""
    warmup = optim.warmup_iterations

    def factor(iteration: int) -> float:
        warm = min(1.0, (iteration + 1) / warmup) if warmup > 0 else 1.0
        if optim.scheduler == "linear":
            return warm * max(0.0, 1.0 - iteration / max(total_iterations, 1))
        return warm

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
