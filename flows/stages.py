"""The pipeline's stages as plain functions of the config (one implementation each).

``dvc.yaml`` runs them as ``ppo <stage>``; the Prefect flow calls the same commands. Each reads
and writes files only, and writes its outputs atomically.

Every stage is registered here, in the order the retraining flow runs them, under
``@stage("name", flow=..., accelerated=..., retries=...)`` (:data:`STAGES`, a
:class:`ppo_core.catalog.Catalog`): the flow's order, its accelerator slots and retries, and a
``ppo <name>`` command for a stage without a command of its own (``flows/cli.py``) all read the
registrations. A stage is added by writing its function here and its entry in ``dvc.yaml``.

Torch, transformers, pandas and Great Expectations (seconds each to import), and the loggers
(rich's progress bars), are imported inside the stages that use them, so that ``ppo --help`` and
the light stages start at once; everything else is imported here. Three stages live in modules
of their own, :mod:`flows.base_model` (``base``), :mod:`flows.reward_stage` (``reward``) and
:mod:`flows.export` (``export``), and are registered here like the others.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flows.base_model import import_base
from flows.export import export_version
from flows.feedback_data import publish_feedback, validate_feedback
from flows.prepare import prepare_prompts
from flows.provenance import code_version
from flows.raw_data import (
    check_raw_data_is_prepared,
)
from ppo_core.catalog import Catalog
from ppo_core.config import Config
from ppo_core.files import (
    MAX_COPY_BYTES,
    atomic_folder,
    copy_regular_file,
)
from ppo_core.files.artifacts import (
    DATA_MANIFEST,
    VALIDATION_RECORD,
)
from ppo_core.prompts import (
    CHAT_FIELD,
    Prompt,
    PromptFileError,
    parse_messages,
    read_manifest_hash,
)
from ppo_core.registry.promotion import promote as run_promotion
from ppo_core.registry.versions import current_production

__all__ = [
    "STAGES",
    "base",
    "evaluate",
    "export",
    "prepare",
    "promote",
    "reward",
    "stage",
    "train",
    "validate",
]

STAGES: Catalog = Catalog(
    "stage", Path(__file__), "stage", traits=("flow", "accelerated", "retries")
)
"""Each stage by its name (``ppo <name>``, the ``dvc.yaml`` stage), in the order the retraining
flow runs them. ``flow``: the flow runs it (``export`` runs on demand); ``accelerated``: it runs
the models, so it holds a slot of ``flow.gpu_limit``; ``retries``: how often the flow retries it
(the long, resumable stages; a validation failure is not retried)."""

stage = STAGES.register


@stage("prepare", flow=True, accelerated=False, retries=0)
def prepare(config: Config) -> Path:
    """Clean, deduplicate and split the raw prompts into a versioned train/eval set, with the
    feedback's pair version beside it (:func:`flows.prepare.prepare_prompts`)."""
    return prepare_prompts(config)


@stage("base", flow=True, accelerated=False, retries=0)
def base(config: Config) -> Path:
    """Import ``base.source`` into ``model.policy``, or build the tiny default there
    (:func:`flows.base_model.import_base`)."""
    return import_base(config)


@stage("validate", flow=True, accelerated=False, retries=0)
def validate(config: Config) -> Path:
    """Check the candidate data version with Great Expectations and publish it when it passes.

    Reads ``data.interim_dir`` (written by ``prepare``), counts prompt tokens with the policy's
    tokenizer, runs the suite of :mod:`flows.validation`, writes Data Docs and ``summary.json`` to
    ``validation.report_dir`` (also on failure), and only then copies the version to
    ``data.prepared_dir`` with ``validated_with.json``, the bound the prompts were held to. A
    violation raises :class:`flows.validation.DataValidationError` and
    leaves the previous prepared version as it was.
    """
    import pandas as pd

    from flows.validation import DataValidationError, validate_prompt_splits
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids, require_chat_template

    interim = Path(config.data.interim_dir)
    files = {name: interim / f"{name}.parquet" for name in ("train", "eval")}
    for path in (*files.values(), interim / DATA_MANIFEST):
        if path.is_symlink() or (path.exists() and not path.is_file()):
            # a link would make validate read, and publish, a file from anywhere
            raise PromptFileError(
                f"{path} is not a regular file (`ppo prepare` writes one); run `ppo prepare` again"
            )
        if not path.is_file():
            raise PromptFileError(f"{path} is missing; run `ppo prepare` first")
    frames = {name: pd.read_parquet(path) for name, path in files.items()}
    tokenizer = load_tokenizer(config.model.policy, config.model.trust_remote_code)
    # a chat version (written by prepare) stores each chat's turns as JSON text in `messages`
    chat = (
        config.data.prompt_field not in frames["train"].columns
        and CHAT_FIELD in frames["train"].columns
    )
    column = CHAT_FIELD if chat else config.data.prompt_field
    if chat:
        require_chat_template(tokenizer, config.model.policy, "model.policy")

    def count_tokens(texts: list[str]) -> list[int]:
        # what generation sees: a chat rendered by the policy's template (prompt_token_ids)
        prompts: list[Prompt] = [
            parse_messages(text, f"{interim}: {CHAT_FIELD}") if chat else text for text in texts
        ]
        return [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]

    rules = config.validation
    result = validate_prompt_splits(
        frames["train"],
        frames["eval"],
        prompt_field=column,
        count_tokens=count_tokens,
        min_tokens=rules.min_tokens,
        max_tokens=rules.max_tokens,
        min_train_rows=rules.min_train_rows,
        min_eval_rows=rules.min_eval_rows,
        report_dir=rules.report_dir,
        reference_fields=config.data.reference_fields,
    )
    if not result.success:
        raise DataValidationError(result)
    # the feedback's pairs pass too, or nothing is published
    feedback_result = validate_feedback(config)
    if feedback_result is not None and not feedback_result.success:
        raise DataValidationError(feedback_result)

    return atomic_folder(config.data.prepared_dir, lambda tmp: _publish(config, interim, tmp))


def _publish(config: Config, interim: Path, tmp: Path) -> None:
    """Write the validated version in ``interim`` to ``tmp`` (the prepared folder to be)."""
    for name in ("train.parquet", "eval.parquet", DATA_MANIFEST):
        # regular files only, never through a link put there since validate's check
        fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            copy_regular_file(interim / name, fd, MAX_COPY_BYTES)
        finally:
            os.close(fd)
    # the bound the prompts were held to travels with them: train and evaluate size their
    # context from it, whatever their own config says (ppo_core.experience.sampling)
    record = {
        "max_tokens": config.validation.max_tokens,
        "min_tokens": config.validation.min_tokens,
        "reference_fields": list(config.data.reference_fields),
        "data_hash": read_manifest_hash(interim / "train.parquet"),
    }
    (tmp / VALIDATION_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    publish_feedback(config, tmp)


@stage("reward", flow=True, accelerated=True, retries=1)
def reward(config: Config, progress=print, on_step=None) -> dict:
    """Train, judge and version the reward model on the feedback's pairs, when
    ``reward.enabled`` (:func:`flows.reward_stage.reward`)."""
    from flows.reward_stage import reward as run_reward

    return run_reward(config, progress=progress, on_step=on_step)


@stage("train", flow=True, accelerated=True, retries=2)
def train(config: Config, show_progress: bool = True):
    """The PPO loop with DVCLive metrics, a progress bar, and ``curves.png`` in the metrics
    folder."""
    from flows.loggers import ConsoleProgress, DVCLiveLogger
    from flows.plots import plot_training_curves
    from ppo_core.parallel.process_group import is_main_process
    from ppo_core.training.loop import train as run_training

    check_raw_data_is_prepared(config)
    loggers: list[DVCLiveLogger | ConsoleProgress] = [DVCLiveLogger(config.train.metrics_dir)]
    if show_progress:
        loggers.append(ConsoleProgress(config.train.iterations))
    try:
        summary = run_training(config, loggers=loggers)
    finally:
        for logger in loggers:
            logger.close()
    if is_main_process():  # under torchrun, rank 0 writes the reports
        plot_training_curves(summary.history, Path(config.train.metrics_dir) / "curves.png")
    return summary


@stage("evaluate", flow=True, accelerated=True, retries=1)
def evaluate(config: Config, candidate: str | None = None, baseline: str | None = None):
    """Evaluate the candidate (default ``train.output_dir``) against a baseline (default
    ``eval.baseline``, else the current production version, else ``model.policy``), both scored
    with ``eval.reward``, else the reward the candidate was trained with, else ``model.reward``.
    A candidate with another tokenizer than the KL reference is refused; a baseline with
    another tokenizer is scored without KL (:mod:`ppo_core.evaluation.evaluate`)."""
    from ppo_core.evaluation.evaluate import evaluate as run_evaluation

    return run_evaluation(
        config,
        candidate or config.train.output_dir,
        baseline if baseline is not None else _evaluation_baseline(config),
    )


def _evaluation_baseline(config: Config) -> str:

    if config.eval.baseline is not None:
        return config.eval.baseline
    production = current_production(config.promote.registry, config.promote.production_dir)
    return str(production) if production is not None else config.model.policy


@stage("promote", flow=True, accelerated=False, retries=0)
def promote(config: Config) -> dict:
    """Apply the promotion gate to the evaluation in ``eval.output_dir``; on a pass, publish the
    candidate as a new production version. Writes the decision to ``promote.report`` either way
    (:func:`ppo_core.registry.promotion.promote`)."""
    return run_promotion(config, code_version())


@stage("export", flow=False, accelerated=False, retries=0)
def export(config: Config) -> dict:
    """The current production version as one GGUF file in ``export.dir``
    (:func:`flows.export.export_version`)."""
    return export_version(config)
