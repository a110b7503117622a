"""The PPO update (layer 3): epochs of shuffled mini-batches, one exact optimizer step each.

Each mini-batch's gradient is accumulated over micro-batches (and data-parallel ranks) so that it
equals the gradient of one pass over the whole mini-batch (docs/design.md section 4); the
objective is :class:`~ppo_core.math.objective.PPOObjective`, the one the tests prove exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch

from ppo_core.config import KLConfig, PPOConfig
from ppo_core.math.accumulation import accumulate_gradients
from ppo_core.math.declarations import DEFAULT_KL_ESTIMATOR, ObjectiveCoefficients
from ppo_core.math.losses import LossParts
from ppo_core.math.masked import select
from ppo_core.math.objective import PPOObjective
from ppo_core.math.running_mean import RunningMean
from ppo_core.models.scoring import score_sequences
from ppo_core.parallel.runtime import Runtime
from ppo_core.training.batch import (
    RolloutBatch,
    cut_micro_batches,
    epochs_of_mini_batches,
    rows_of_this_rank,
)

__all__ = ["NonFiniteError", "clip_and_check_gradients", "objective_from", "ppo_update"]


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached a reward, a loss or a gradient; the update was not applied."""


def objective_from(
    ppo: PPOConfig, kl: KLConfig | None = None, kl_coef: float = 0.0
) -> PPOObjective:
    """The PPO objective with the coefficients of the ``ppo`` config section, and with the KL
    term ``kl_coef`` (the controller's current ``beta``) when ``kl.in_loss`` puts it there."""
    in_loss = kl is not None and kl.in_loss
    return PPOObjective(
        **{field.name: getattr(ppo, field.name) for field in fields(ObjectiveCoefficients)},
        kl_coef=kl_coef if in_loss else 0.0,
        kl_estimator=kl.estimator if kl is not None else DEFAULT_KL_ESTIMATOR,
    )


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    *,
    ppo: PPOConfig,
    temperature: float,
    generator: torch.Generator,
    runtime: Runtime | None = None,
    objective: PPOObjective | None = None,
) -> dict[str, float]:
    """``ppo.epochs`` passes over shuffled mini-batches; one optimizer step per mini-batch, each
    the exact gradient of the mini-batch objective accumulated over micro-batches.

    Args:
        model: the :class:`~ppo_core.models.policy.ActorCritic`, or its DDP wrapper.
        batch: this rank's rows of the rollout batch.
        ppo: sizes, coefficients, ``target_kl`` and ``max_grad_norm``.
        temperature: the sampling temperature, so logprobs describe the sampled distribution.
        generator: the shuffle's random stream.
        runtime: device, ranks and autocast; one CPU process when ``None``.
        objective: the loss; ``None`` is :func:`objective_from` ``(ppo)`` (no KL term).

    Under data parallelism ``batch`` holds rows ``[rank * b, (rank + 1) * b)`` of a global rollout
    batch of ``world_size * b`` rows and ``ppo.mini_batch_size`` is per rank: every rank draws the
    same shuffle of the global rows, and global mini-batch ``k`` is the next
    ``world_size * mini_batch_size`` of them, each rank working on the ones it holds (their number
    varies; a rank holding none contributes an all-masked micro-batch so that the gradient
    all-reduce still happens). The result equals one process holding every row.

    Returns:
        ``ppo/*`` metrics: token-weighted means over every step, ``ppo/optimizer_steps`` and
        ``ppo/early_stopped`` (1.0 when ``target_kl`` cut the epochs short).
    """
    runtime = runtime or Runtime()
    objective = objective or objective_from(ppo)
    world_size = runtime.parallel.world_size
    loss_fn = functools.partial(
        _micro_batch_loss,
        model=model,
        objective=objective,
        temperature=temperature,
        runtime=runtime,
    )
    # Named once: a non-finite gradient is reported by the parameter's name.
    parameter_names = {id(p): name for name, p in model.named_parameters()}
    totals: dict[str, RunningMean] = {}
    steps = 0
    early_stopped = False
    for indices in epochs_of_mini_batches(len(batch) * world_size, ppo, world_size, generator):
        mini_batch = rows_of_this_rank(batch, indices, runtime.parallel.rank)
        micro_batches = cut_micro_batches(mini_batch, indices, len(batch), runtime.parallel, ppo)
        stats = _optimizer_step(
            model,
            optimizer,
            micro_batches,
            loss_fn,
            objective,
            ppo.max_grad_norm,
            mini_batch,
            parameter_names,
        )
        steps += 1
        for name, value in stats.items():
            totals[name] = totals[name].merge(value) if name in totals else value
        if ppo.target_kl is not None and stats["ppo/approx_kl"].item() > ppo.target_kl:
            early_stopped = True
            break
    optimizer.zero_grad(set_to_none=True)
    metrics = {name: value.item() for name, value in totals.items()}
    metrics["ppo/optimizer_steps"] = float(steps)
    metrics["ppo/early_stopped"] = float(early_stopped)
    return metrics


def _micro_batch_loss(
    micro: RolloutBatch,
    *,
    model: torch.nn.Module,
    objective: PPOObjective,
    temperature: float,
    runtime: Runtime,
) -> tuple[LossParts, dict[str, RunningMean]]:
    """The objective's loss parts and ``ppo/*`` statistics on one micro-batch, scored by
    ``model`` under autocast."""
    with runtime.autocast():
        out = score_sequences(
            model,
            micro.prompt_ids,
            micro.prompt_mask,
            micro.response_ids,
            micro.response_mask,
            temperature=temperature,
            with_values=micro.old_values is not None,
            with_entropy=True,
            entropy_grad=objective.entropy_coef > 0,
        )
    parts, stats = objective(
        out.logprobs,
        out.values,
        out.entropy,
        micro.old_logprobs,
        micro.old_values,
        micro.advantages,
        micro.returns,
        micro.response_mask,
        ref_logprobs=micro.ref_logprobs,
        importance_weights=micro.importance_weights,
    )
    return parts, {f"ppo/{name}": value for name, value in stats.items()}


def _optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[RolloutBatch],
    loss_fn: Callable[[RolloutBatch], tuple[LossParts, dict[str, RunningMean]]],
    objective: PPOObjective,
    max_grad_norm: float | None,
    mini_batch: RolloutBatch,
    parameter_names: dict[int, str],
) -> dict[str, RunningMean]:
    """One optimizer step on the exact gradient of a mini-batch, accumulated over its
    micro-batches (and ranks); returns the step's statistics, reduced over the ranks."""
    optimizer.zero_grad(set_to_none=True)
    result = accumulate_gradients(
        micro_batches,
        loss_fn,
        count_fn=lambda micro: objective.count(micro.response_mask),
        no_sync=getattr(model, "no_sync", None),
    )
    # One check per mini-batch, on the loss every rank sees, before the step (a check per
    # micro-batch would stall the device between each forward and backward pass).
    loss = result.loss.all_reduce()
    if not torch.isfinite(loss.mean):
        _raise_non_finite_loss(result.stats, mini_batch)
    parameters = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_and_check_gradients(parameters, max_grad_norm, parameter_names)
    optimizer.step()
    stats = {name: value.all_reduce() for name, value in result.stats.items()}
    stats["ppo/loss"] = loss
    stats["ppo/grad_norm"] = RunningMean.of(grad_norm, 1)
    return stats


def _raise_non_finite_loss(stats: dict[str, RunningMean], mini_batch: RolloutBatch) -> None:
    """Name which loss term, and which rollout input under the mask, is not finite on this rank;
    called before the optimizer step, so none is taken."""
    bad_terms = [
        name
        for name in ("policy", "value", "kl")
        if f"ppo/{name}_loss" in stats and not torch.isfinite(stats[f"ppo/{name}_loss"].mean)
    ]
    bad_inputs = [
        name
        for name in ("old_logprobs", "ref_logprobs", "advantages", "returns", "old_values")
        if getattr(mini_batch, name) is not None
        and not torch.isfinite(
            select(getattr(mini_batch, name).float(), mini_batch.response_mask)
        ).all()
    ]
    terms = " and ".join(bad_terms) or "another rank's"
    raise NonFiniteError(
        f"the PPO loss is not finite ({terms} loss term{'s' if len(bad_terms) > 1 else ''}; "
        "non-finite rollout inputs: "
        f"{', '.join(bad_inputs) or 'none, so the model produced it'}); the optimizer step was "
        "not taken and no checkpoint was written"
    )


def clip_and_check_gradients(
    parameters: Sequence[torch.nn.Parameter],
    max_grad_norm: float | None,
    names: dict[int, str] | None = None,
) -> float:
    """Clip the global gradient norm; refuse to step on a non-finite gradient, naming the first
    parameter whose gradient holds a NaN or inf."""
    limit = max_grad_norm if max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, limit)
    if hasattr(norm, "full_tensor"):  # sharded gradients (FSDP) give a distributed norm
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        culprit = next(
            (p for p in parameters if p.grad is not None and not torch.isfinite(p.grad).all()), None
        )
        where = (names or {}).get(id(culprit), "a parameter") if culprit is not None else "?"
        raise NonFiniteError(
            f"the gradient norm is {norm.item()} (first non-finite gradient: {where}): a NaN or "
            "inf reached the loss or the gradient; the optimizer step was not taken"
        )
    return float(norm)
