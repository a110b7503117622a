"""The PPO run (layer 3): set up, iterate rollout -> advantages -> exact update, save.

Each iteration follows Ziegler et al. (2019) and Stiennon et al. (2020) as in the classic TRL
sentiment example, with the exact micro-batch accumulation of docs/design.md section 4. Read
:func:`train` top to bottom:

1. :func:`~ppo_core.runtime.setup_runtime`: threads, device, data-parallel ranks, autocast;
2. :func:`check_inputs`: model folders, prompts, tokenizer, reward; nothing is written before;
3. :func:`resolve_resume`: the newest good checkpoint that continues this very run, if any;
4. :func:`build_models`: policy with value head (DDP-wrapped for the update), frozen reference;
5. :class:`TrainState`: optimizer, scheduler, KL controller, iteration and history, which is
   exactly what a checkpoint stores besides the weights;
6. :func:`run_iteration`, once per iteration, checkpointing every ``train.checkpoint_every``;
7. :func:`save_output`: the final policy with its config and lineage.

Randomness is drawn from named streams seeded per iteration (:class:`RandomStream`), so a run
resumed from a checkpoint draws the same prompts, samples and shuffles as an uninterrupted one.
"""

from __future__ import annotations

import enum
import functools
import json
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ppo_core.config import Config, OptimConfig, flatten, save_config, to_yaml
from ppo_core.distributed import DataParallel, is_main_process
from ppo_core.files import atomic_folder, check_replaceable, discard, exclusive_run
from ppo_core.math.kl import AdaptiveKLController, FixedKLController
from ppo_core.modeling.checkpoint import (
    checked_history,
    list_checkpoints,
    load_latest_good,
    load_sharded_checkpoint,
    remove_partial,
    save_checkpoint,
    save_sharded_checkpoint,
)
from ppo_core.modeling.data import Prompt, load_prompts, prompt_text, read_manifest_hash
from ppo_core.modeling.generation import check_chat_template
from ppo_core.modeling.lora import (
    AdapterReference,
    LoraSettings,
    adapter_dropout,
    add_reference_adapter,
)
from ppo_core.modeling.policy import (
    ActorCritic,
    ModelFolderError,
    check_model_folder,
    checkpoint_blocks,
    load_actor_critic,
    load_tokenizer,
)
from ppo_core.modeling.reward_loading import RewardFn
from ppo_core.modeling.vocabulary import reference_vocabulary, vocabulary_mismatch, vocabulary_of
from ppo_core.parallel import ParallelStrategy, make_strategy
from ppo_core.rollout import build_reward, collect_rollout, load_reference
from ppo_core.runtime import Runtime, setup_runtime
from ppo_core.update import objective_from, ppo_update

__all__ = [
    "TIMINGS",
    "MetricsLogger",
    "RandomStream",
    "TrainState",
    "TrainSummary",
    "train",
]

SampleCallback = Callable[[int, list[str], list[str]], None]
"""Called with ``(iteration, prompts, responses)`` of a few rollout rows after each iteration."""


class MetricsLogger(Protocol):
    """Receives the metrics of every iteration (DVCLive, console, a list in a test)."""

    def log(self, iteration: int, metrics: dict[str, float]) -> None: ...


@dataclass
class TrainSummary:
    """What a finished run produced."""

    output_dir: Path
    iterations: int
    resumed_from: int
    final_metrics: dict[str, float]
    history: list[dict[str, float]]


TIMINGS = "perf/"
"""The group of wall-clock measurements (``perf/rollout_s``, ``perf/tokens_per_s``, ...)."""


def without_timings(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without :data:`TIMINGS`. Loggers get every metric, but checkpoints and the
    candidate are DVC outputs, which must hold the same bytes whenever the same inputs are run
    again, so no wall-clock time is written into them."""
    return {name: value for name, value in metrics.items() if not name.startswith(TIMINGS)}


# -- randomness ---------------------------------------------------------------------------------


class RandomStream(enum.IntEnum):
    """The run's independent random streams; each is seeded afresh every iteration."""

    PROMPT_DRAW = 0
    """Which training prompts an iteration samples (with replacement)."""
    SAMPLING = 1
    """Token sampling in ``generate``, one seed per generation chunk."""
    SHUFFLE = 2
    """The order of rollout rows in the mini-batches of every epoch."""


def stream_seed(seed: int, iteration: int, stream: RandomStream, chunk: int = 0) -> int:
    """A distinct, reproducible seed for each (run seed, iteration, stream, generation chunk)."""
    code = int(stream) + 1000 * chunk
    return (seed * 1_000_003 + iteration * 7_919 + code * 104_729) % (2**63 - 1)


def draw_prompts(
    train_prompts: Sequence[Prompt], config: Config, iteration: int, parallel: DataParallel
) -> list[Prompt]:
    """This rank's rows of the iteration's global prompt batch: prompts drawn with replacement,
    each repeated ``ppo.samples_per_prompt`` times in consecutive rows. The per-rank batch is a
    multiple of the group size, so every group lies whole on one rank, where its advantages are
    computed (docs/design.md section 4)."""
    draw = torch.Generator().manual_seed(
        stream_seed(config.seed, iteration, RandomStream.PROMPT_DRAW)
    )
    group = config.ppo.samples_per_prompt
    global_size = config.ppo.rollout_batch_size * parallel.world_size
    picks = torch.randint(len(train_prompts), (global_size // group,), generator=draw)
    picks = picks.repeat_interleave(group)
    first, last = parallel.rows(config.ppo.rollout_batch_size)
    return [train_prompts[i] for i in picks[first:last].tolist()]


def sampling_seeds(config: Config, iteration: int, parallel: DataParallel) -> list[int]:
    """One seed per generation chunk of this rank, numbered across ranks, so that the same
    global batch samples the same responses on any number of ranks (when the chunk size divides
    the per-rank batch)."""
    per_rank = config.ppo.rollout_batch_size
    chunk = config.ppo.generation_batch_size or per_rank
    chunks = -(-per_rank // chunk)
    return [
        stream_seed(config.seed, iteration, RandomStream.SAMPLING, parallel.rank * chunks + k)
        for k in range(chunks)
    ]


# -- setup ----------------------------------------------------------------------------------------


@dataclass
class RunInputs:
    """Everything a run reads besides the weights, checked before anything is written."""

    train_prompts: list[Prompt]
    tokenizer: Any
    data_hash: str | None
    reward_fn: RewardFn


def check_inputs(config: Config, runtime: Runtime) -> RunInputs:
    """Check the model folders, read the prompts and the tokenizer, build the reward; a bad
    input fails here, naming it, while every file on disk is as it was."""
    model = config.model
    # A foreign folder in the output's place would only be found at the final save.
    check_replaceable(config.train.output_dir)
    check_model_folder(model.policy, "model.policy")
    tokenizer = load_tokenizer(model.policy, model.trust_remote_code)
    if model.reference is not None:
        check_model_folder(model.reference, "model.reference")
        # The KL penalty compares the two models' logprobs of one token id: meaningless unless
        # both vocabularies map ids to the same text.
        policy_vocab = vocabulary_of(model.policy, tokenizer)
        reference_vocab = reference_vocabulary(
            model.policy, model.reference, model.trust_remote_code
        )
        mismatch = vocabulary_mismatch(policy_vocab, reference_vocab)
        if mismatch is not None:
            raise ModelFolderError(
                f"model.reference {reference_vocab.describe()} has another tokenizer than "
                f"model.policy {policy_vocab.describe()}: {mismatch}; the KL penalty needs one "
                "vocabulary (model.reference=null uses the starting policy)"
            )
    train_prompts = load_prompts(
        config.data.train_file,
        config.data.prompt_field,
        max_rows=config.data.max_rows_per_file,
        max_bytes=config.data.max_bytes_per_file,
    )
    check_chat_template(tokenizer, train_prompts, model.policy, "model.policy")
    return RunInputs(
        train_prompts=train_prompts,
        tokenizer=tokenizer,
        data_hash=read_manifest_hash(config.data.train_file),
        reward_fn=build_reward(model, runtime.device),
    )


# Keys that may change between a run and its resumption without changing what it computes.
RESUME_FREE_KEYS = (
    "train.iterations",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.keep_set_aside",
    "train.resume",
    "train.allow_stale_data",
    "train.gradient_checkpointing",
    "model.lora.merge",
    "model.reward_timeout",
    "threads",
    "ppo.scoring_batch_size",
    "eval.",
    "promote.",
    "schedule.",
    "flow.",
    "validation.",
    "parallel.",
)


# Sizes given per data-parallel rank: a checkpoint continues a run with the same global sizes
# (the value times the world size), whatever the number of ranks.
PER_RANK_KEYS = ("ppo.rollout_batch_size", "ppo.mini_batch_size")


def resume_mismatch(
    config: Config, state: dict[str, Any], data_hash: str | None, world_size: int = 1
) -> str | None:
    """Why a checkpoint cannot continue this run (another config or data version), or None."""
    if state.get("data_hash") != data_hash:
        return f"it was trained on data version {state.get('data_hash')}, this run has {data_hash}"
    from omegaconf import OmegaConf

    before = flatten(OmegaConf.create(state.get("config", "{}")))
    now = flatten(config)
    before_ranks = int(state.get("world_size", 1))
    old_per_rank = {key: before.get(key) for key in PER_RANK_KEYS}
    for key in PER_RANK_KEYS:
        if isinstance(before.get(key), int) and isinstance(now.get(key), int):
            before[key] = f"{before[key] * before_ranks} in all"
            now[key] = f"{now[key] * world_size} in all"
    changed = sorted(
        k
        for k in before.keys() | now.keys()
        if before.get(k) != now.get(k) and not k.startswith(RESUME_FREE_KEYS)
    )
    if changed:
        return (
            "its config differs in "
            + ", ".join(f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in changed[:5])
            + _per_rank_hint(old_per_rank, changed, before_ranks, world_size)
        )
    if int(state["iteration"]) > config.train.iterations:
        return f"it is at iteration {state['iteration']}, past train.iterations={config.train.iterations}"
    return None


def _per_rank_hint(
    old: dict[str, Any], changed: list[str], before_ranks: int, world_size: int
) -> str:
    """For per-rank sizes (``old``: the checkpoint's values) that changed only because the
    number of ranks did: the per-rank value that continues the old run on this many ranks, or
    why none does."""
    if before_ranks == world_size:
        return ""
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    hints = []
    for key in PER_RANK_KEYS:
        if key not in changed or not isinstance(old.get(key), int):
            continue
        total = old[key] * before_ranks
        if total % world_size:
            hints.append(f"{key}: the old run's {total} in all does not divide over {ranks}")
        else:
            hints.append(f"{key}={total // world_size} continues it on {ranks}")
    return f" ({'; '.join(hints)})" if hints else ""


def set_aside_checkpoints(checkpoint_dir: str | Path, keep: int) -> tuple[Path, list[Path]]:
    """Move the checkpoints of another run to ``stale-<time>/`` and keep the newest ``keep``
    such folders; returns the new folder and the removed ones."""
    folder = Path(checkpoint_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stale = folder / f"stale-{stamp}"
    number = 1
    while stale.exists():  # two restarts within one second
        number += 1
        stale = folder / f"stale-{stamp}-{number}"
    stale.mkdir(parents=True)
    for path in list_checkpoints(folder):
        path.rename(stale / path.name)
    set_aside = sorted(p for p in folder.glob("stale-*") if p.is_dir())
    removed = set_aside[: max(len(set_aside) - keep, 0)]
    for old in removed:
        discard(old)
    return stale, removed


def resolve_resume(
    config: Config, runtime: Runtime, data_hash: str | None
) -> dict[str, Any] | None:
    """The newest good checkpoint that continues this run (same config and data), or None.

    Called under the run lock. What a killed run left half-written is removed first; a damaged
    checkpoint is skipped for the previous good one; checkpoints of another config or data
    version are set aside (moved, never deleted) and the run starts over.
    """
    parallel = runtime.parallel
    if parallel.is_main:
        for name in remove_partial(config.train.checkpoint_dir):
            warnings.warn(f"removed {name}, left half-written by an interrupted run", stacklevel=3)
    if not config.train.resume:
        return None
    folder, checkpoint, damaged = load_latest_good(config.train.checkpoint_dir)
    for problem in damaged:
        warnings.warn(f"skipping damaged checkpoint {problem}", stacklevel=3)
    if checkpoint is None:
        return None
    reason = resume_mismatch(config, checkpoint["state"], data_hash, runtime.parallel.world_size)
    if reason is None:
        return checkpoint
    parallel.barrier()  # every rank has read the checkpoint list before it moves
    if parallel.is_main:
        keep = config.train.keep_set_aside
        stale, removed = set_aside_checkpoints(config.train.checkpoint_dir, keep)
        kept = f"moved to {stale}" if keep else "removed (train.keep_set_aside=0)"
        dropped = (
            f"; removed the oldest set-aside runs {', '.join(p.name for p in removed)} "
            f"(train.keep_set_aside={keep})"
            if removed and keep
            else ""
        )
        warnings.warn(
            f"not resuming from {folder}: {reason}; training starts over from model.policy and "
            f"the old checkpoints were {kept}{dropped}. To continue the old run instead, undo "
            "the change",
            stacklevel=3,
        )
    return None


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
    model, lora = config.model, config.model.lora
    start_folder = checkpoint or (lora.adapter if lora.enabled and lora.adapter else model.policy)
    actor_critic = strategy.load(
        lambda: load_actor_critic(
            start_folder,
            model.critic,
            model.trust_remote_code,
            lora=lora_settings(config) if lora.enabled else None,
            lora_base=model.policy,
        )
    )
    if config.train.gradient_checkpointing:
        checkpoint_blocks(actor_critic)
    reference: torch.nn.Module
    if lora.enabled and model.reference is None:
        if lora.adapter is not None:
            add_reference_adapter(actor_critic.policy, lora.adapter, model.policy)
        reference = AdapterReference(actor_critic.policy, lora.adapter is not None)
    else:
        reference = strategy.wrap_reference(strategy.load(lambda: load_reference(model, None)))
    return Models(
        actor_critic=actor_critic,
        update_model=strategy.wrap(actor_critic),
        reference=reference,
        strategy=strategy,
    )


def lora_settings(config: Config) -> LoraSettings:
    lora = config.model.lora
    return LoraSettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
    )


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


@dataclass
class IterationResult:
    metrics: dict[str, float]
    prompts: list[Prompt]
    responses: list[str]


def run_iteration(
    config: Config, runtime: Runtime, inputs: RunInputs, models: Models, state: TrainState
) -> IterationResult:
    """One PPO iteration; advances ``state`` by one and appends its metrics to the history."""
    iteration, parallel = state.iteration, runtime.parallel
    started = time.perf_counter()
    # 1. Draw this rank's prompts of the global batch.
    prompts = draw_prompts(inputs.train_prompts, config, iteration, parallel)
    # 2. Rollout: sample responses, score them, per-token rewards with KL, GAE advantages
    # (a sharded policy is gathered whole for it, not once per block per generated token).
    gathering = time.perf_counter()
    with models.strategy.gathered(models.actor_critic):
        gathered = time.perf_counter()
        batch, metrics, responses = collect_rollout(
            models.actor_critic,
            models.reference,
            inputs.tokenizer,
            prompts,
            inputs.reward_fn,
            ppo=config.ppo,
            generation=config.generation,
            kl=config.kl,
            kl_coef=state.kl_controller.value,
            runtime=runtime,
            chunk_seeds=sampling_seeds(config, iteration, parallel),
            # sharded parameters must stay FSDP's: the adapter is merged only when unsharded
            merge_adapter=not models.strategy.sharded,
        )
    rollout_done = time.perf_counter()
    # 3. PPO epochs over shuffled mini-batches, each step the exact mini-batch gradient.
    shuffle = torch.Generator().manual_seed(
        stream_seed(config.seed, iteration, RandomStream.SHUFFLE)
    )
    with adapter_dropout(models.actor_critic.policy, config.model.lora.dropout > 0):
        metrics.update(
            ppo_update(
                models.update_model,
                state.optimizer,
                batch,
                ppo=config.ppo,
                temperature=config.generation.temperature,
                generator=shuffle,
                runtime=runtime,
                objective=objective_from(config.ppo, config.kl, state.kl_controller.value),
            )
        )
    # 4. Adapt the KL coefficient and the learning rate.
    state.kl_controller.update(metrics["rollout/kl"], len(batch) * parallel.world_size)
    metrics["optim/lr"] = float(state.scheduler.get_last_lr()[0])
    state.scheduler.step()
    finished = time.perf_counter()
    tokens = float(batch.response_mask.sum()) * parallel.world_size
    metrics.update(
        {
            "perf/rollout_s": rollout_done - started,
            **({"perf/gather_s": gathered - gathering} if models.strategy.sharded else {}),
            "perf/update_s": finished - rollout_done,
            "perf/iteration_s": finished - started,
            "perf/tokens_per_s": tokens / max(finished - started, 1e-9),
        }
    )
    state.iteration += 1
    state.history.append({"iteration": float(state.iteration), **metrics})
    return IterationResult(metrics, prompts, responses)


def train(
    config: Config, loggers: Sequence[MetricsLogger] = (), on_samples: SampleCallback | None = None
) -> TrainSummary:
    """Run ``config.train.iterations`` PPO iterations, resuming from the newest checkpoint.

    Writes checkpoints to ``train.checkpoint_dir`` and the final policy, with its config and
    lineage, to ``train.output_dir`` (atomically; a failed run leaves the previous one in place).
    A second run on the same checkpoint folder refuses to start while the first one runs.
    """
    checkpoints = Path(config.train.checkpoint_dir)
    if not is_main_process():  # under torchrun, rank 0 holds the lock
        return _run(config, loggers, on_samples)
    lock = checkpoints.parent / f".{checkpoints.name}.lock"
    with exclusive_run(lock, f"training run on {checkpoints}"):
        return _run(config, loggers, on_samples)


def _run(
    config: Config, loggers: Sequence[MetricsLogger], on_samples: SampleCallback | None
) -> TrainSummary:
    runtime = setup_runtime(config)
    # a strategy that cannot run here (fsdp in one process) fails before anything is read
    strategy = make_strategy(
        config.parallel.strategy,
        runtime.parallel,
        runtime.device,
        config.precision,
        config.parallel.reference_offload,
    )
    inputs = check_inputs(config, runtime)
    checkpoint = resolve_resume(config, runtime, inputs.data_hash)
    models = build_models(
        config, runtime, strategy, checkpoint["model_dir"] if checkpoint else None
    )
    state = build_train_state(config, models.actor_critic)
    if checkpoint is not None:
        state.restore(checkpoint, models)
    resumed_from = state.iteration
    is_main = runtime.parallel.is_main
    loggers = loggers if is_main else ()
    for past in state.history:  # loggers see the whole run, not only its resumed part
        for logger in loggers:
            logger.log(int(past["iteration"]), {k: v for k, v in past.items() if k != "iteration"})
    lineage = {**run_lineage(config, inputs.data_hash), "world_size": runtime.parallel.world_size}
    metrics: dict[str, float] = state.history[-1] if state.history else {}
    while state.iteration < config.train.iterations:
        result = run_iteration(config, runtime, inputs, models, state)
        metrics = result.metrics
        for logger in loggers:
            logger.log(state.iteration, metrics)
        if on_samples is not None and is_main:
            shown = [prompt_text(prompt) for prompt in result.prompts[:4]]
            on_samples(state.iteration, shown, result.responses[:4])
        if (
            state.iteration % config.train.checkpoint_every == 0
            or state.iteration == config.train.iterations
        ):
            state.save(config, models, inputs.tokenizer, lineage, runtime.parallel)
    # The candidate is gathered whole on rank 0; the optimizer's moments are not needed any more
    # and are freed first, so that the gathered copy takes their room instead of adding to them.
    state.optimizer.state.clear()
    output_dir = save_output(
        config,
        runtime,
        models.actor_critic,
        inputs.tokenizer,
        {**lineage, "final_metrics": without_timings(metrics), "resumed_from": resumed_from},
        full_state=full_model_state(models),
    )
    return TrainSummary(
        output_dir=output_dir,
        iterations=config.train.iterations,
        resumed_from=resumed_from,
        final_metrics=metrics,
        history=state.history,
    )


def full_model_state(models: Models) -> dict[str, torch.Tensor] | None:
    """The actor-critic's whole state on rank 0 when it is sharded (a collective: every rank
    calls it), else None: an unsharded model is saved from its own parameters."""
    return models.strategy.full_state(models.actor_critic)


def run_lineage(config: Config, data_hash: str | None) -> dict[str, Any]:
    """What made a checkpoint: the data version and file, the base model and the config."""
    return {
        "data_hash": data_hash,
        "train_file": config.data.train_file,
        "base_model": str(config.model.policy),
        "config": to_yaml(config),
    }


def save_output(
    config: Config,
    runtime: Runtime,
    actor_critic: ActorCritic,
    tokenizer: Any,
    summary: dict[str, Any],
    full_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the trained policy, ``ppo_config.yaml`` and ``training_summary.json`` to
    ``train.output_dir`` atomically (rank 0 writes, every rank waits).

    The summary names the reward the policy was trained with and its KL reference, so that
    ``ppo evaluate`` scores the candidate with that reward unless told otherwise."""
    output_dir = Path(config.train.output_dir)
    trained_with = {
        "reward": config.model.reward,
        "reference": str(config.model.reference or config.model.policy),
    }

    def write(folder: Path) -> None:
        actor_critic.save(folder, tokenizer, merged=config.model.lora.merge, full_state=full_state)
        save_config(config, folder / "ppo_config.yaml")
        described = {k: v for k, v in summary.items() if k != "config"}
        (folder / "training_summary.json").write_text(
            json.dumps(
                {
                    "iterations": config.train.iterations,
                    "seed": config.seed,
                    **trained_with,
                    **described,
                },
                indent=1,
            )
        )

    if runtime.parallel.is_main:
        atomic_folder(output_dir, write)
    runtime.parallel.barrier()
    return output_dir
