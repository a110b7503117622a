"""The PPO run (layer 3): set up, iterate rollout -> advantages -> exact update, save.

Each iteration follows Ziegler et al. (2019) and Stiennon et al. (2020) as in the classic TRL
sentiment example, with the exact micro-batch accumulation of docs/design.md section 4. Read
:func:`train` top to bottom:

1. :func:`~ppo_core.parallel.runtime.setup_runtime`: threads, device, data-parallel ranks, autocast;
2. :func:`check_inputs` (``training/inputs.py``): model folders, prompts, tokenizer, reward;
   nothing is written before;
3. :func:`resolve_resume` (``training/resume.py``): the newest good checkpoint that continues
   this very run, if any;
4. :func:`build_models` (``training/networks.py``): policy with value head (DDP-wrapped for the
   update), frozen reference;
5. :class:`TrainState` (``training/state.py``): optimizer, scheduler, KL controller, iteration
   and history, which is exactly what a checkpoint stores besides the weights;
6. :func:`run_iteration`, once per iteration, checkpointing every ``train.checkpoint_every``;
7. :func:`save_output`: the final policy with its config and lineage.

Randomness is drawn from named streams seeded per iteration (:class:`RandomStream`,
``training/seeds.py``), so a run
resumed from a checkpoint draws the same prompts, samples and shuffles as an uninterrupted one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ppo_core.config import Config, save_config, to_yaml
from ppo_core.experience.engines import VLLMEngine, open_engine
from ppo_core.experience.judges import with_resolved_reward
from ppo_core.experience.sampling import with_validated_settings
from ppo_core.files import atomic_folder, exclusive_run
from ppo_core.files.artifacts import TRAINED_CONFIG, TRAINING_SUMMARY
from ppo_core.models.policy import ActorCritic
from ppo_core.parallel.process_group import is_main_process
from ppo_core.parallel.runtime import Runtime, setup_runtime
from ppo_core.parallel.strategies import make_strategy
from ppo_core.prompts import Prompt, prompt_text
from ppo_core.references import batch_references
from ppo_core.training.inputs import RunInputs, check_inputs
from ppo_core.training.networks import Models, build_models
from ppo_core.training.resume import resolve_resume
from ppo_core.training.rollout import SamplerGapWatch, collect_rollout
from ppo_core.training.seeds import RandomStream, draw_prompts, sampling_seeds, stream_seed
from ppo_core.training.state import TrainState, build_train_state, without_timings
from ppo_core.training.stopwatch import TIMINGS, Stopwatch
from ppo_core.training.update import objective_from, ppo_update

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


@dataclass
class IterationResult:
    metrics: dict[str, float]
    prompts: list[Prompt]
    responses: list[str]


def run_iteration(
    config: Config,
    runtime: Runtime,
    inputs: RunInputs,
    models: Models,
    state: TrainState,
    engine: VLLMEngine | None = None,
) -> IterationResult:
    """One PPO iteration; advances ``state`` by one and appends its metrics to the history
    (``engine``: the stage's vLLM engine for ``generation.engine=vllm``)."""
    iteration, parallel = state.iteration, runtime.parallel
    watch = Stopwatch()
    with watch.step("rollout"):
        # 1. Draw this rank's prompts of the global batch.
        prompts = draw_prompts(inputs.train_prompts, config, iteration, parallel)
        # the same draw of the rows' reference fields (the draw depends on the count alone)
        references = batch_references(
            draw_prompts(inputs.train_references, config, iteration, parallel)
            if inputs.train_references is not None
            else None,
            config.data.reference_fields,
        )
        # 2. Rollout: sample responses, score them, per-token rewards with KL, GAE advantages
        # (a sharded policy is gathered whole for it, not once per block per generated token).
        with watch.entering("gather", models.strategy.gathered(models.actor_critic)):
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
                engine=engine,
                measure_gap=iteration % config.ppo.sampler_gap_every == 0,
                references=references,
            )
    with watch.step("update"):
        # 3. PPO epochs over shuffled mini-batches, each step the exact mini-batch gradient.
        shuffle = torch.Generator().manual_seed(
            stream_seed(config.seed, iteration, RandomStream.SHUFFLE)
        )
        with models.actor_critic.updating():
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
    metrics.update(_timings(watch, float(batch.response_mask.sum()) * parallel.world_size, models))
    metrics.update(runtime.chosen.metrics())
    state.iteration += 1
    state.history.append({"iteration": float(state.iteration), **metrics})
    return IterationResult(metrics, prompts, responses)


def _timings(watch: Stopwatch, tokens: float, models: Models) -> dict[str, float]:
    """``perf/*`` of one iteration: rollout, update, their sum and the response tokens a second;
    the time to gather a sharded policy only when it is sharded."""
    timings = {
        name: seconds
        for name, seconds in watch.metrics().items()
        if name != f"{TIMINGS}gather_s" or models.strategy.sharded
    }
    iteration_s = watch.seconds["rollout"] + watch.seconds["update"]
    timings[f"{TIMINGS}iteration_s"] = iteration_s
    timings[f"{TIMINGS}tokens_per_s"] = tokens / max(iteration_s, 1e-9)
    return timings


def train(
    config: Config, loggers: Sequence[MetricsLogger] = (), on_samples: SampleCallback | None = None
) -> TrainSummary:
    """Run ``config.train.iterations`` PPO iterations, resuming from the newest checkpoint.

    The prompt token bound is the one ``ppo validate`` held the data to, where it recorded one
    (:func:`~ppo_core.experience.sampling.with_validated_settings`). Writes checkpoints to
    ``train.checkpoint_dir`` and the final policy, with its config and
    lineage, to ``train.output_dir`` (atomically; a failed run leaves the previous one in place).
    A second run on the same checkpoint folder refuses to start while the first one runs.
    """
    checkpoints = Path(config.train.checkpoint_dir)
    config = with_resolved_reward(config)  # reward:current -> the version it names now
    config = with_validated_settings(config, config.data.train_file)
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
        runtime.precision,
        config.parallel.reference_offload,
    )
    inputs = check_inputs(config, runtime)
    checkpoint = resolve_resume(config, runtime, inputs.data_hash, inputs.base_sha256)
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
    lineage = {
        **run_lineage(config, inputs.data_hash),
        "base_sha256": inputs.base_sha256,
        "world_size": runtime.parallel.world_size,
    }
    metrics: dict[str, float] = state.history[-1] if state.history else {}
    gap_watch = SamplerGapWatch(config.ppo, config.generation, runtime.precision)
    # one start per stage, its context sized for the longest prompt any rank may draw
    with open_engine(config, runtime, config.model.policy, inputs.longest_prompt) as engine:
        while state.iteration < config.train.iterations:
            result = run_iteration(config, runtime, inputs, models, state, engine)
            metrics = result.metrics
            if is_main:
                gap_watch.check(state.iteration, metrics)
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
        "reward_terms": list(config.model.reward_terms),
        "reward_weights": list(config.model.reward_weights),
        "reference": str(config.model.reference or config.model.policy),
    }

    def write(folder: Path) -> None:
        actor_critic.save(folder, tokenizer, merged=config.model.lora.merge, full_state=full_state)
        save_config(config, folder / TRAINED_CONFIG)
        described = {k: v for k, v in summary.items() if k != "config"}
        (folder / TRAINING_SUMMARY).write_text(
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
