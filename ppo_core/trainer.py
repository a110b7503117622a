"""The PPO loop (layer 3): rollout -> scores -> rewards with KL -> GAE -> epochs of exact updates.

Each iteration follows Ziegler et al. (2019) and Stiennon et al. (2020) as in the classic TRL
sentiment example, with the exact micro-batch accumulation of DESIGN.md section 4. Randomness is
seeded per iteration from ``(seed, iteration)``, so a run resumed from a checkpoint draws the same
prompts, samples and shuffles as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ppo_core.config import Config, flatten, save_config, to_yaml
from ppo_core.distributed import init_distributed
from ppo_core.math.accumulation import accumulate_gradients
from ppo_core.math.batching import micro_batch_slices, minibatch_indices
from ppo_core.math.gae import compute_gae, whiten_advantages
from ppo_core.math.kl import AdaptiveKLController, FixedKLController, kl_penalty, token_rewards
from ppo_core.math.losses import aggregate_loss, count_units, policy_loss, value_loss
from ppo_core.math.masked import masked_moments, masked_sum, select
from ppo_core.math.running_mean import RunningMean
from ppo_core.modeling.checkpoint import (
    atomic_folder,
    exclusive_run,
    list_checkpoints,
    load_latest_good,
    remove_partial,
    save_checkpoint,
)
from ppo_core.modeling.data import load_prompts, read_manifest_hash
from ppo_core.modeling.generation import concat_generated, decode_responses, generate_responses
from ppo_core.modeling.policy import (
    ActorCritic,
    check_model_folder,
    load_actor_critic,
    load_causal_lm,
    load_tokenizer,
    score_sequences,
)
from ppo_core.modeling.reward_loading import build_reward_fn, checked_scores

__all__ = [
    "MetricsLogger",
    "RolloutBatch",
    "TrainSummary",
    "collect_rollout",
    "ppo_update",
    "resolve_device",
    "train",
]


class MetricsLogger(Protocol):
    """Receives the metrics of every iteration (DVCLive, console, a list in a test)."""

    def log(self, iteration: int, metrics: dict[str, float]) -> None: ...


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached a reward, a loss or a gradient; the update was not applied."""


@dataclass
class RolloutBatch:
    """One iteration's experience. Token fields are ``[B, T]``, ``scores`` is ``[B]``."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] real response tokens, first EOS included
    old_logprobs: Tensor  # [B, T] sampling policy
    ref_logprobs: Tensor  # [B, T] frozen reference
    old_values: Tensor  # [B, T] critic at rollout time
    scores: Tensor  # [B] sequence scores (after the missing-EOS penalty)
    rewards: Tensor  # [B, T] -beta * kl + score on the last token
    advantages: Tensor  # [B, T] whitened once per rollout batch
    returns: Tensor  # [B, T]

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def rows(self, index: Tensor | slice) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every row: left prompt padding
        and response positions after the longest response (at least one column is kept).

        Exact: positions come from the attention mask, padded keys are masked out, and causal
        attention means no kept position looks at a dropped later one; the loss sums over
        masked tokens only. A micro-batch of short responses then costs what its tokens cost.
        """
        prompt_cols = self.prompt_mask.any(dim=0).nonzero()
        response_cols = self.response_mask.any(dim=0).nonzero()
        first = int(prompt_cols[0]) if len(prompt_cols) else 0
        end = int(response_cols[-1]) + 1 if len(response_cols) else 1
        if first == 0 and end == self.response_ids.shape[1]:
            return self
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("prompt_"):
                value = value[:, first:]
            elif value.dim() == 2:
                value = value[:, :end]
            values[f.name] = value
        return RolloutBatch(**values)


@dataclass
class TrainSummary:
    """What a finished run produced."""

    output_dir: Path
    iterations: int
    resumed_from: int
    final_metrics: dict[str, float]
    history: list[dict[str, float]]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device; use device=auto or cpu")
    return torch.device(name)


def autocast_context(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """Factory of the autocast context for forward passes (bf16 when asked, else nothing)."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def iteration_seed(seed: int, iteration: int, stream: int) -> int:
    """A distinct, reproducible seed for each (run seed, iteration, random stream)."""
    return (seed * 1_000_003 + iteration * 7_919 + stream * 104_729) % (2**63 - 1)


@torch.no_grad()
def collect_rollout(
    actor_critic: ActorCritic,
    reference: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    reward_fn: Callable[[list[str], list[str]], Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    kl_estimator: str,
    kl_coef: float,
    gamma: float,
    lam: float,
    whiten: bool,
    missing_eos_penalty: float | None,
    forward_batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    chunk_seeds: Sequence[int] | None = None,
    all_ranks: bool = False,
) -> tuple[RolloutBatch, dict[str, float], list[str]]:
    """Generate, score and turn one batch of prompts into advantages and returns.

    With ``chunk_seeds`` the prompts are sampled in ``len(chunk_seeds)`` equal chunks, chunk ``i``
    after ``torch.manual_seed(chunk_seeds[i])``. With ``all_ranks`` the advantages are whitened
    and the metrics averaged over every data-parallel rank's rows.
    """
    seeds = list(chunk_seeds) if chunk_seeds else [None]
    if len(prompts) % len(seeds):
        raise ValueError(f"{len(prompts)} prompts do not split into {len(seeds)} generation chunks")
    size = len(prompts) // len(seeds)
    pieces = []
    for index, seed in enumerate(seeds):
        if seed is not None:
            torch.manual_seed(seed)
        with autocast():
            pieces.append(generate_responses(
                actor_critic.policy, tokenizer, prompts[index * size : (index + 1) * size],
                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                device=device,
            ))
    generated = concat_generated(pieces, tokenizer.pad_token_id)
    old_logprobs, ref_logprobs, old_values = [], [], []
    for chunk in micro_batch_slices(len(prompts), forward_batch_size):
        args = (generated.prompt_ids[chunk], generated.prompt_mask[chunk],
                generated.response_ids[chunk], generated.response_mask[chunk])
        with autocast():
            policy_out = score_sequences(actor_critic, *args, temperature=temperature)
            ref_out = score_sequences(reference, *args, temperature=temperature, with_values=False)
        old_logprobs.append(policy_out.logprobs)
        old_values.append(policy_out.values)
        ref_logprobs.append(ref_out.logprobs)
    old_logprobs_t = torch.cat(old_logprobs)
    ref_logprobs_t = torch.cat(ref_logprobs)
    old_values_t = torch.cat(old_values)
    mask = generated.response_mask

    responses = decode_responses(tokenizer, generated.response_ids, mask)
    scores = checked_scores(reward_fn(prompts, responses), len(prompts)).to(device)
    raw_scores = scores
    if missing_eos_penalty is not None:
        scores = torch.where(generated.has_eos, scores, scores - missing_eos_penalty)

    kl = kl_penalty(old_logprobs_t, ref_logprobs_t, kl_estimator, mask)
    rewards = token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = compute_gae(rewards, old_values_t, mask, gamma, lam)
    if whiten:
        advantages = whiten_advantages(advantages, mask, all_ranks=all_ranks)

    batch = RolloutBatch(
        prompt_ids=generated.prompt_ids, prompt_mask=generated.prompt_mask,
        response_ids=generated.response_ids, response_mask=mask,
        old_logprobs=old_logprobs_t, ref_logprobs=ref_logprobs_t, old_values=old_values_t,
        scores=scores, rewards=rewards, advantages=advantages, returns=returns,
    )
    sequence_kl = masked_sum(kl, mask, dim=1)
    per_sequence = {
        "rollout/score": raw_scores,
        "rollout/positive_rate": (raw_scores > 0.05).float(),
        "rollout/kl": sequence_kl,
        "rollout/reward": masked_sum(rewards, mask, dim=1),
        "rollout/response_length": mask.sum(dim=1).float(),
        "rollout/eos_rate": generated.has_eos.float(),
    }
    means = {name: RunningMean.from_sum(v.sum(), len(v)) for name, v in per_sequence.items()}
    means["rollout/value_mean"] = RunningMean.from_masked(old_values_t, mask)
    metrics = {name: (m.all_reduce() if all_ranks else m).item() for name, m in means.items()}
    every_row = torch.ones_like(raw_scores, dtype=torch.bool)
    metrics["rollout/score_std"] = (
        float(masked_moments(raw_scores, every_row, all_ranks=all_ranks)[1]) ** 0.5
        if len(prompts) > 1 or all_ranks else 0.0
    )
    metrics["rollout/kl_coef"] = float(kl_coef)
    return batch, metrics, responses


def ppo_update(
    actor_critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    *,
    epochs: int,
    mini_batch_size: int,
    micro_batch_size: int,
    clip_eps: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
    clip_eps_value: float | None,
    vf_coef: float,
    entropy_coef: float,
    loss_agg_mode: str,
    max_grad_norm: float | None,
    target_kl: float | None,
    temperature: float,
    generator: torch.Generator,
    drop_last: bool = False,
    group: object | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """``epochs`` passes over shuffled mini-batches; one optimizer step per mini-batch, each the
    exact gradient of the mini-batch objective accumulated over micro-batches.

    Under data parallelism ``batch`` holds this rank's rows ``[rank * b, (rank + 1) * b)`` of a
    global rollout batch of ``world_size * b`` rows and ``mini_batch_size`` is per rank: every
    rank draws the same shuffle of the global rows, and global mini-batch ``k`` is the next
    ``world_size * mini_batch_size`` of them, each rank working on the ones it holds (their
    number varies; a rank holding none contributes an all-masked micro-batch so the gradient
    all-reduce still happens). The result equals one process holding every row.
    """
    parameters = [p for p in actor_critic.parameters() if p.requires_grad]
    names = {id(p): name for name, p in actor_critic.named_parameters()}
    no_sync = getattr(actor_critic, "no_sync", None)
    totals: dict[str, RunningMean] = {}
    steps = 0
    early_stopped = 0.0

    def loss_fn(mb: RolloutBatch):
        with autocast():
            out = score_sequences(
                actor_critic, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                temperature=temperature, with_entropy=True, entropy_grad=entropy_coef > 0,
            )
        mask = mb.response_mask
        pg = policy_loss(out.logprobs, mb.old_logprobs, mb.advantages, mask, clip_eps,
                         clip_eps_high, dual_clip)
        vf = value_loss(out.values, mb.old_values, mb.returns, mask, clip_eps_value)
        token_losses = pg.token_losses + vf_coef * vf.token_losses
        entropy = out.entropy
        if entropy_coef > 0:
            token_losses = token_losses - entropy_coef * entropy
        parts = aggregate_loss(token_losses, mask, loss_agg_mode)
        stats = {
            "ppo/policy_loss": RunningMean.from_masked(pg.token_losses.detach(), mask),
            "ppo/value_loss": RunningMean.from_masked(vf.token_losses.detach(), mask),
            "ppo/approx_kl": pg.approx_kl,
            "ppo/clipfrac": pg.clipfrac,
            "ppo/ratio": pg.ratio,
            "ppo/vf_clipfrac": vf.clipfrac,
            "ppo/entropy": RunningMean.from_masked(entropy.detach(), mask),
        }
        if dual_clip is not None:
            stats["ppo/dual_clipfrac"] = pg.dual_clipfrac
        return parts, stats

    local_rows = len(batch)
    first_row = rank * local_rows
    for _epoch in range(epochs):
        for indices in minibatch_indices(local_rows * world_size, mini_batch_size * world_size,
                                         generator, drop_last=drop_last):
            mine = indices[(indices >= first_row) & (indices < first_row + local_rows)] - first_row
            if len(mine) == 0:
                mini = batch.rows(slice(0, 1))
                mini.response_mask = torch.zeros_like(mini.response_mask)
            else:
                mini = batch.rows(mine.to(batch.response_ids.device))
            micro_batches = [mini.rows(s).trimmed()
                             for s in micro_batch_slices(len(mini), micro_batch_size)]
            optimizer.zero_grad(set_to_none=True)
            result = accumulate_gradients(
                micro_batches, loss_fn,
                count_fn=lambda mb: count_units(mb.response_mask, loss_agg_mode),
                group=group, no_sync=no_sync,
            )
            # One check per mini-batch, on the loss every rank sees, before the step (a check per
            # micro-batch would stall the device between each forward and backward pass).
            mini_batch_loss = result.loss.all_reduce(group)
            if not torch.isfinite(mini_batch_loss.mean):
                _raise_non_finite_loss(result.stats, mini)
            grad_norm = _clip_and_check(parameters, max_grad_norm, names)
            optimizer.step()
            steps += 1
            stats = {name: value.all_reduce(group) for name, value in result.stats.items()}
            stats["ppo/loss"] = mini_batch_loss
            stats["ppo/grad_norm"] = RunningMean.of(grad_norm, 1)
            for name, value in stats.items():
                totals[name] = totals[name].merge(value) if name in totals else value
            if target_kl is not None and stats["ppo/approx_kl"].item() > target_kl:
                early_stopped = 1.0
                break
        if early_stopped:
            break
    optimizer.zero_grad(set_to_none=True)
    metrics = {name: value.item() for name, value in totals.items()}
    metrics["ppo/optimizer_steps"] = float(steps)
    metrics["ppo/early_stopped"] = early_stopped
    return metrics


def _raise_non_finite_loss(stats: dict[str, RunningMean], mini: RolloutBatch) -> None:
    """Name which loss term, and which rollout input under the mask, is not finite on this rank;
    called before the optimizer step, so none is taken."""
    bad_terms = [name for name in ("policy", "value")
                 if not torch.isfinite(stats[f"ppo/{name}_loss"].mean)]
    bad_inputs = [name for name in ("old_logprobs", "advantages", "returns", "old_values")
                  if not torch.isfinite(select(getattr(mini, name).float(), mini.response_mask)).all()]
    terms = " and ".join(bad_terms) or "another rank's"
    raise NonFiniteError(
        f"the PPO loss is not finite ({terms} loss term{'s' if len(bad_terms) > 1 else ''}; "
        "non-finite rollout inputs: "
        f"{', '.join(bad_inputs) or 'none, so the model produced it'}); the optimizer step was "
        "not taken and no checkpoint was written"
    )


def _clip_and_check(parameters: Sequence[torch.nn.Parameter], max_grad_norm: float | None,
                    names: dict[int, str] | None = None) -> float:
    """Clip the global gradient norm; refuse to step on a non-finite gradient, naming the first
    parameter whose gradient holds a NaN or inf."""
    limit = max_grad_norm if max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, limit)
    if not torch.isfinite(norm):
        culprit = next((p for p in parameters
                        if p.grad is not None and not torch.isfinite(p.grad).all()), None)
        where = (names or {}).get(id(culprit), "a parameter") if culprit is not None else "?"
        raise NonFiniteError(
            f"the gradient norm is {norm.item()} (first non-finite gradient: {where}): a NaN or "
            "inf reached the loss or the gradient; the optimizer step was not taken"
        )
    return float(norm)


# Keys that may change between a run and its resumption without changing what it computes.
RESUME_FREE_KEYS = ("train.iterations", "train.checkpoint_every", "train.keep_checkpoints",
                    "train.log_every", "train.resume", "threads", "ppo.scoring_batch_size",
                    "eval.", "promote.",
                    "schedule.", "validation.")


def resume_mismatch(config: Config, state: dict[str, Any], data_hash: str | None) -> str | None:
    """Why a checkpoint cannot continue this run (another config or data version), or None."""
    if state.get("data_hash") != data_hash:
        return f"it was trained on data version {state.get('data_hash')}, this run has {data_hash}"
    from omegaconf import OmegaConf

    before = flatten(OmegaConf.create(state.get("config", "{}")))
    now = flatten(config)
    changed = sorted(k for k in before.keys() | now.keys()
                     if before.get(k) != now.get(k) and not k.startswith(RESUME_FREE_KEYS))
    if changed:
        return "its config differs in " + ", ".join(
            f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in changed[:5])
    if int(state["iteration"]) > config.train.iterations:
        return f"it is at iteration {state['iteration']}, past train.iterations={config.train.iterations}"
    return None


def set_aside_checkpoints(checkpoint_dir: str | Path) -> Path:
    """Move the checkpoints of another run out of the way (kept, not deleted)."""
    folder = Path(checkpoint_dir)
    stale = folder / f"stale-{time.strftime('%Y%m%d-%H%M%S')}"
    stale.mkdir(parents=True, exist_ok=True)
    for path in list_checkpoints(folder):
        path.rename(stale / path.name)
    return stale


def build_optimizer(parameters: Iterable[torch.nn.Parameter], *, name: str, lr: float,
                    weight_decay: float, betas: Sequence[float], eps: float,
                    momentum: float) -> torch.optim.Optimizer:
    params = [p for p in parameters if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                 betas=(betas[0], betas[1]), eps=eps)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose adamw or sgd")


def build_scheduler(optimizer: torch.optim.Optimizer, *, kind: str, warmup: int, total: int):
    def factor(iteration: int) -> float:
        warm = min(1.0, (iteration + 1) / warmup) if warmup > 0 else 1.0
        if kind == "linear":
            return warm * max(0.0, 1.0 - iteration / max(total, 1))
        return warm

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_reward(config: Config, device: torch.device) -> Callable[[list[str], list[str]], Tensor]:
    return build_reward_fn(config.model.reward, device=device,
                           trust_remote_code=config.model.trust_remote_code)


def train(config: Config, loggers: Sequence[MetricsLogger] = (),
          on_samples: Callable[[int, list[str], list[str]], None] | None = None) -> TrainSummary:
    """Run ``config.train.iterations`` PPO iterations, resuming from the newest checkpoint.

    Writes checkpoints to ``train.checkpoint_dir`` and the final policy, with its config and
    lineage, to ``train.output_dir`` (atomically; a failed run leaves the previous one in place).
    A second run on the same checkpoint folder refuses to start while the first one runs.
    """
    checkpoints = Path(config.train.checkpoint_dir)
    lock = checkpoints.parent / f".{checkpoints.name}.lock"
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 holds the lock
        return _train(config, loggers, on_samples)
    with exclusive_run(lock, f"training run on {checkpoints}"):
        return _train(config, loggers, on_samples)


def _train(config: Config, loggers: Sequence[MetricsLogger],
           on_samples: Callable[[int, list[str], list[str]], None] | None) -> TrainSummary:
    # 0. Setup: numerics, data, models, optimizer.
    if config.threads:
        torch.set_num_threads(config.threads)
    parallel, device = init_distributed(resolve_device(config.device))
    autocast = autocast_context(device, config.precision)
    trust = config.model.trust_remote_code
    # Check every input before writing anything.
    check_model_folder(config.model.policy, "model.policy")
    if config.model.reference is not None:
        check_model_folder(config.model.reference, "model.reference")
    train_prompts = load_prompts(config.data.train_file, config.data.prompt_field)
    tokenizer = load_tokenizer(config.model.policy, trust)
    data_hash = read_manifest_hash(config.data.train_file)
    if parallel.is_main:  # under the run lock: what a killed run left half-written goes first
        for name in remove_partial(config.train.checkpoint_dir):
            warnings.warn(f"removed {name}, left half-written by an interrupted run", stacklevel=2)
    checkpoint, loaded, damaged = (
        load_latest_good(config.train.checkpoint_dir) if config.train.resume else (None, None, [])
    )
    for problem in damaged:
        warnings.warn(f"skipping damaged checkpoint {problem}", stacklevel=2)
    if loaded is not None:
        reason = resume_mismatch(config, loaded["state"], data_hash)
        if reason is not None:
            parallel.barrier()  # every rank has read the checkpoint list before it moves
            if parallel.is_main:
                stale = set_aside_checkpoints(config.train.checkpoint_dir)
                warnings.warn(f"not resuming from {checkpoint}: {reason}; starting over (the old "
                              f"checkpoints were moved to {stale})", stacklevel=2)
            loaded = None
    start_folder = loaded["model_dir"] if loaded else config.model.policy
    torch.manual_seed(config.seed)
    actor_critic = load_actor_critic(start_folder, config.model.critic, trust).to(device)
    reference = load_causal_lm(config.model.reference or config.model.policy, "reference", trust)
    reference.requires_grad_(False)
    reference.to(device)
    reward_fn = build_reward(config, device)
    update_model: torch.nn.Module = actor_critic
    if parallel.active:
        from torch.nn.parallel import DistributedDataParallel

        update_model = DistributedDataParallel(
            actor_critic, device_ids=[device.index] if device.type == "cuda" else None
        )
    optim = config.optim
    optimizer = build_optimizer(actor_critic.parameters(), name=optim.name, lr=optim.lr,
                                weight_decay=optim.weight_decay, betas=optim.betas,
                                eps=optim.eps, momentum=optim.momentum)
    scheduler = build_scheduler(optimizer, kind=optim.scheduler, warmup=optim.warmup_iterations,
                                total=config.train.iterations)
    kl_cfg = config.kl
    controller: FixedKLController | AdaptiveKLController = (
        AdaptiveKLController(kl_cfg.coef, kl_cfg.target, kl_cfg.horizon)
        if kl_cfg.adaptive else FixedKLController(kl_cfg.coef)
    )
    start_iteration = 0
    history: list[dict[str, float]] = []
    if loaded:
        optimizer.load_state_dict(loaded["optimizer"])
        if loaded["scheduler"] is not None:
            scheduler.load_state_dict(loaded["scheduler"])
        start_iteration = int(loaded["state"]["iteration"])
        controller.value = float(loaded["state"]["kl_coef"])
        history = list(loaded["state"].get("history", []))
        for past in history:  # loggers see the whole run, not only its resumed part
            for logger in loggers if parallel.is_main else ():
                logger.log(int(past["iteration"]), {k: v for k, v in past.items() if k != "iteration"})
    ppo, gen = config.ppo, config.generation

    def lineage() -> dict[str, Any]:
        return {"data_hash": data_hash, "train_file": config.data.train_file,
                "base_model": str(config.model.policy), "config": to_yaml(config)}

    def write_checkpoint(iteration: int) -> None:
        if parallel.is_main:
            save_checkpoint(
                config.train.checkpoint_dir, iteration,
                lambda folder: actor_critic.save(folder, tokenizer), optimizer, scheduler,
                {"kl_coef": controller.value, "history": history, **lineage()},
                keep=config.train.keep_checkpoints,
            )
        parallel.barrier()  # no rank runs ahead of a checkpoint it may have to resume from

    metrics: dict[str, float] = history[-1] if history else {}
    for iteration in range(start_iteration, config.train.iterations):
        started = time.perf_counter()
        # 1. Draw this iteration's prompts.
        # Prompts and sampling seeds are drawn for the global batch; this rank takes its rows.
        draw = torch.Generator().manual_seed(iteration_seed(config.seed, iteration, 0))
        picks = torch.randint(len(train_prompts), (ppo.rollout_batch_size * parallel.world_size,),
                              generator=draw)
        first, last = parallel.rows(ppo.rollout_batch_size)
        prompts = [train_prompts[i] for i in picks[first:last].tolist()]
        chunk = ppo.generation_batch_size or ppo.rollout_batch_size
        chunk_seeds = [iteration_seed(config.seed, iteration, 1 + 1000 * index)
                       for index in range(first // chunk, last // chunk)]
        # 2. Rollout: sample responses, score them, per-token rewards with KL, GAE.
        batch, metrics, responses = collect_rollout(
            actor_critic, reference, tokenizer, prompts, reward_fn,
            max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
            top_p=gen.top_p, kl_estimator=kl_cfg.estimator, kl_coef=controller.value,
            gamma=ppo.gamma, lam=ppo.lam, whiten=ppo.whiten_advantages,
            missing_eos_penalty=ppo.missing_eos_penalty,
            forward_batch_size=ppo.scoring_batch_size or ppo.micro_batch_size,
            device=device, autocast=autocast, chunk_seeds=chunk_seeds,
            all_ranks=parallel.active,
        )
        rollout_done = time.perf_counter()
        # 3. PPO epochs over shuffled mini-batches with exact micro-batch accumulation.
        shuffle = torch.Generator().manual_seed(iteration_seed(config.seed, iteration, 2))
        metrics.update(ppo_update(
            update_model, optimizer, batch, epochs=ppo.epochs, mini_batch_size=ppo.mini_batch_size,
            micro_batch_size=ppo.micro_batch_size, clip_eps=ppo.clip_eps,
            clip_eps_high=ppo.clip_eps_high, dual_clip=ppo.dual_clip,
            clip_eps_value=ppo.clip_eps_value, vf_coef=ppo.vf_coef,
            entropy_coef=ppo.entropy_coef, loss_agg_mode=ppo.loss_agg_mode,
            max_grad_norm=ppo.max_grad_norm, target_kl=ppo.target_kl,
            temperature=gen.temperature, generator=shuffle, drop_last=ppo.drop_last,
            autocast=autocast, rank=parallel.rank, world_size=parallel.world_size,
        ))
        # 4. Adapt the KL coefficient and the learning rate.
        controller.update(metrics["rollout/kl"], len(batch) * parallel.world_size)
        metrics["optim/lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        finished = time.perf_counter()
        tokens = float(batch.response_mask.sum()) * parallel.world_size
        metrics.update({
            "perf/rollout_s": rollout_done - started,
            "perf/update_s": finished - rollout_done,
            "perf/iteration_s": finished - started,
            "perf/tokens_per_s": tokens / max(finished - started, 1e-9),
        })
        history.append({"iteration": float(iteration + 1), **metrics})
        for logger in loggers if parallel.is_main else ():
            logger.log(iteration + 1, metrics)
        if on_samples is not None and parallel.is_main:
            on_samples(iteration + 1, prompts[:4], responses[:4])
        # 5. Checkpoint every N iterations and at the end.
        last = iteration + 1 == config.train.iterations
        if (iteration + 1) % config.train.checkpoint_every == 0 or last:
            write_checkpoint(iteration + 1)

    def write_output(folder: Path) -> None:
        actor_critic.save(folder, tokenizer)
        save_config(config, folder / "ppo_config.yaml")
        (folder / "training_summary.json").write_text(json.dumps({
            "iterations": config.train.iterations, "final_metrics": metrics,
            "data_hash": data_hash, "train_file": config.data.train_file,
            "base_model": str(config.model.policy), "seed": config.seed,
        }, indent=1))

    output_dir = Path(config.train.output_dir)
    if parallel.is_main:
        atomic_folder(output_dir, write_output)
    parallel.barrier()
    return TrainSummary(output_dir=output_dir, iterations=config.train.iterations,
                        resumed_from=start_iteration, final_metrics=metrics, history=history)

