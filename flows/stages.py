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

import hashlib
import json
import os
from pathlib import Path

from flows.base_model import import_base
from flows.export import export_version
from flows.feedback_data import prepare_feedback, publish_feedback, validate_feedback
from flows.provenance import code_version
from flows.raw_data import (
    check_raw_data_is_prepared,
    in_eval_split,
    normalise_prompt,
    raw_sources,
    read_raw_prompts,
)
from ppo_core.catalog import Catalog
from ppo_core.config import Config
from ppo_core.files import (
    MAX_COPY_BYTES,
    atomic_folder,
    atomic_write_text,
    check_replaceable_file,
    copy_regular_file,
    file_sha256,
    printable,
)
from ppo_core.files.output_paths import real_path
from ppo_core.prompts import (
    CHAT_FIELD,
    Prompt,
    PromptFileError,
    is_chat,
    parquet_size,
    parse_messages,
    project_path,
)
from ppo_core.registry.gate import gate
from ppo_core.registry.lineage import read_lineage
from ppo_core.registry.versions import current_production, record_decision

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
    """Clean, deduplicate and split the raw prompts into a versioned train/eval set.

    Reads every ``*.jsonl`` / ``*.parquet`` in ``data.raw_dir`` (sorted by name), strips and
    normalises whitespace, drops empty prompts and duplicates (first occurrence wins), splits by a
    hash of each prompt, and writes ``train.parquet``, ``eval.parquet`` and ``manifest.json``
    (content hash, counts, source files with their hashes) into ``data.interim_dir``, atomically;
    ``validate`` publishes it to ``data.prepared_dir``. The feedback in ``data.feedback_dir``
    becomes a pair version in ``feedback/`` beside the splits (:mod:`flows.feedback_data`).
    A malformed line fails the stage naming its file and line; nothing is written then. So does a
    raw file over ``data.max_rows_per_file`` or ``data.max_bytes_per_file``, and a split over them
    (training and evaluation read the splits under the same caps). The manifest names each source
    as ``project_path`` does: relative to the working folder, or by its name alone outside it.
    """
    import pandas as pd

    data = config.data
    prompts, counts, source_info, chat = _distinct_prompts(config)
    column = CHAT_FIELD if chat else data.prompt_field
    evals = [p for p in prompts if in_eval_split(p, data.split_seed, data.eval_fraction)]
    trains = [p for p in prompts if not in_eval_split(p, data.split_seed, data.eval_fraction)]
    if not trains or not evals:
        raise PromptFileError(
            f"{len(prompts)} distinct prompts give {len(trains)} train and {len(evals)} eval "
            f"prompts with data.eval_fraction={data.eval_fraction}; both splits need prompts"
        )
    # Each split is a prompt file that `ppo train` or `ppo evaluate` reads under the same caps.
    readers = {"train": "`ppo train`", "eval": "`ppo evaluate`"}
    for split, items in (("train", trains), ("eval", evals)):
        if len(items) > data.max_rows_per_file:
            raise PromptFileError(
                f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {len(items)} prompts, "
                f"more than data.max_rows_per_file={data.max_rows_per_file}, so {readers[split]} "
                "could not read it; raise the limit"
            )
    content = hashlib.sha256()
    for split, items in (("train", trains), ("eval", evals)):
        for prompt in items:
            content.update(f"{split}\x00{prompt}\n".encode())
    # the feedback's pair version, read (and refused when malformed) before anything is written
    feedback = prepare_feedback(config)
    manifest = {
        "content_hash": content.hexdigest(),
        "counts": {**counts, "train": len(trains), "eval": len(evals)},
        "eval_fraction": data.eval_fraction,
        "split_seed": data.split_seed,
        "sources": source_info,
    }

    def write(tmp: Path) -> None:
        for split, items in (("train", trains), ("eval", evals)):
            pd.DataFrame({column: items}).to_parquet(tmp / f"{split}.parquet", index=False)
            # the size a reader measures first, known only once written
            _, size = parquet_size(tmp / f"{split}.parquet", column)
            if size > data.max_bytes_per_file:
                raise PromptFileError(
                    f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {size} bytes "
                    f"uncompressed, more than data.max_bytes_per_file={data.max_bytes_per_file}, "
                    f"so {readers[split]} could not read it; raise the limit"
                )
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        feedback.write(tmp)

    return atomic_folder(data.interim_dir, write)


def _distinct_prompts(config: Config) -> tuple[list[str], dict[str, int], list[dict], bool]:
    """The normalised, distinct prompts of every raw file in order (first occurrence wins),
    with the counts of raw, empty and duplicate rows, each source file's record, and whether
    they are chats; a mix of plain and chat files is refused naming one of each."""
    data = config.data
    sources = raw_sources(Path(data.raw_dir))
    if not sources:
        raise PromptFileError(f"no .jsonl or .parquet prompt files in {str(Path(data.raw_dir))!r}")
    seen: set[str] = set()
    prompts: list[str] = []
    counts = {"raw": 0, "empty": 0, "duplicates": 0}
    source_info = []
    first_of_kind: dict[bool, str] = {}  # is_chat -> the first source file of that kind
    for source in sources:
        rows = read_raw_prompts(config, source)
        source_info.append(
            {"file": project_path(source), "sha256": file_sha256(source), "rows": len(rows)}
        )
        for raw in rows:
            first_of_kind.setdefault(is_chat(raw), project_path(source))
            counts["raw"] += 1
            prompt = normalise_prompt(raw)
            if not prompt:
                counts["empty"] += 1
            elif prompt in seen:
                counts["duplicates"] += 1
            else:
                seen.add(prompt)
                prompts.append(prompt)
    if len(first_of_kind) > 1:
        raise PromptFileError(
            f"{first_of_kind[False]} holds plain {data.prompt_field!r} rows and "
            f"{first_of_kind[True]} chat {CHAT_FIELD!r} rows; a data version holds one kind "
            "(write a plain prompt as a chat with one user turn to mix them)"
        )
    return prompts, counts, source_info, bool(first_of_kind.get(True))


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
    ``data.prepared_dir``. A violation raises :class:`flows.validation.DataValidationError` and
    leaves the previous prepared version as it was.
    """
    import pandas as pd

    from flows.validation import DataValidationError, validate_prompt_splits
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids, require_chat_template

    interim = Path(config.data.interim_dir)
    files = {name: interim / f"{name}.parquet" for name in ("train", "eval")}
    for path in (*files.values(), interim / "manifest.json"):
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
    )
    if not result.success:
        raise DataValidationError(result)
    # the feedback's pairs pass too, or nothing is published
    feedback_result = validate_feedback(config)
    if feedback_result is not None and not feedback_result.success:
        raise DataValidationError(feedback_result)

    def publish(tmp: Path) -> None:
        for name in ("train.parquet", "eval.parquet", "manifest.json"):
            # regular files only, never through a link put there since the check above
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                copy_regular_file(interim / name, fd, MAX_COPY_BYTES)
            finally:
                os.close(fd)
        publish_feedback(config, tmp)

    return atomic_folder(config.data.prepared_dir, publish)


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


def _is_report(content: bytes) -> bool:
    """Whether ``content`` is a promotion report as :func:`promote` writes it."""
    try:
        report = json.loads(content)
    except ValueError:
        return False
    return isinstance(report, dict) and report.get("decision") in ("promoted", "rejected")


class StaleEvaluationError(ValueError):
    """The evaluation in ``eval.output_dir`` is not one of this candidate with these settings."""


def _evaluation_of_this_candidate(config: Config, metrics_file: Path) -> tuple[dict, dict]:
    """``metrics.json`` and ``models.json`` of the evaluation in ``eval.output_dir``, checked to
    be an evaluation of ``train.output_dir``, scored by ``promote.check_reward`` when that guard
    is on: the gate decides on nothing else (an evaluation of another folder, or one whose check
    score came from another scorer, is :class:`StaleEvaluationError`)."""
    again = "; run `ppo evaluate` again with the same settings"
    read = {}
    for name in ("metrics.json", "models.json"):
        path = metrics_file.with_name(name)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; run `ppo evaluate` first")
        try:
            read[name] = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise StaleEvaluationError(f"{path} is not valid JSON{again}") from None
        if not isinstance(read[name], dict):
            raise StaleEvaluationError(f"{path} is not a JSON object{again}")
    models = read["models.json"]
    evaluated = models.get("candidate")
    if not isinstance(evaluated, str) or real_path(evaluated) != real_path(config.train.output_dir):
        raise StaleEvaluationError(
            f"{metrics_file.with_name('models.json')} is an evaluation of "
            f"{printable(str(evaluated))!r}, not of train.output_dir="
            f"{config.train.output_dir!r}{again}"
        )
    wanted = config.promote.check_reward
    if wanted is not None and models.get("check_reward") != wanted:
        raise StaleEvaluationError(
            f"the evaluation was scored with check_reward "
            f"{printable(str(models.get('check_reward')))!r}, but promote.check_reward is "
            f"{config.promote.check_reward!r}{again}"
        )
    return read["metrics.json"], models


@stage("promote", flow=True, accelerated=False, retries=0)
def promote(config: Config) -> dict:
    """Apply the promotion gate to the evaluation in ``eval.output_dir``; on a pass, publish the
    candidate as a new production version. Writes the decision to ``promote.report`` either way."""
    from flows.loggers import metric_group  # rich's progress bars: only train and promote

    rules = config.promote
    # Checked before anything is decided or published: the decision must be writable.
    check_replaceable_file(rules.report, "promote.report", "a promotion report", _is_report)
    metrics_file = Path(config.eval.output_dir) / "metrics.json"
    flat, models = _evaluation_of_this_candidate(config, metrics_file)

    def side(name: str) -> dict[str, float] | None:
        return metric_group(flat, name) or None

    candidate = side("candidate")
    if candidate is None:
        raise ValueError(f"{metrics_file} has no candidate metrics")
    decision = gate(candidate, side("baseline"), rules, config.generation.max_new_tokens)
    summary_file = Path(config.train.output_dir) / "training_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    config_file = Path(config.train.output_dir) / "ppo_config.yaml"
    trained_with = config_file.read_text() if config_file.is_file() else None
    entry = record_decision(
        registry_path=rules.registry,
        production_dir=rules.production_dir,
        candidate_dir=config.train.output_dir,
        decision=decision,
        base_dir=config.model.policy,
        lineage={
            **read_lineage(config.model.policy).as_record(),
            "data_hash": summary.get("data_hash"),
            "base_model": summary.get("base_model"),
            "code_version": code_version(),
            "seed": summary.get("seed"),
            "config": trained_with,
            "metrics": candidate,
            "baseline_metrics": side("baseline"),
            "baseline": models.get("baseline"),
            "reward": models.get("reward"),
            "previous_reward": models.get("previous_reward"),
        },
    )
    # The report is a DVC output, so it holds only what the stage's inputs determine (a rerun of
    # one commit writes the same bytes); when, and from which commit, stay in the registry.
    report = {key: value for key, value in entry.items() if key not in ("date", "code_version")}
    atomic_write_text(rules.report, json.dumps(report, indent=1))
    return entry


@stage("export", flow=False, accelerated=False, retries=0)
def export(config: Config) -> dict:
    """The current production version as one GGUF file in ``export.dir``
    (:func:`flows.export.export_version`)."""
    return export_version(config)
