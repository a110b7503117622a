"""The ``promote`` stage's inputs and decision: the evaluation it decides on, checked to be this
candidate's, the gate (:mod:`ppo_core.registry.gate`), and the registry entry with the
candidate's lineage (:func:`ppo_core.registry.versions.record_decision`).

The inputs are the files the earlier stages left (``ppo_core.files.artifacts``): the flat
``metrics.json`` and the ``models.json`` of ``eval.output_dir``, and the candidate's
``training_summary.json`` and ``ppo_config.yaml``. ``flows/stages.py::promote`` calls
:func:`promote` with the commit of the code that runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ppo_core.config import Config
from ppo_core.files import atomic_write_text, check_replaceable_file, printable
from ppo_core.files.artifacts import (
    EVAL_METRICS,
    EVAL_MODELS,
    TRAINED_CONFIG,
    metric_group,
    read_training_summary,
)
from ppo_core.files.output_paths import real_path
from ppo_core.registry.gate import gate
from ppo_core.registry.lineage import read_lineage
from ppo_core.registry.rewards import REWARD_SPEC_PREFIX, load_reward_registry
from ppo_core.registry.versions import record_decision

__all__ = ["StaleEvaluationError", "evaluation_of_candidate", "is_promotion_report", "promote"]


class StaleEvaluationError(ValueError):
    """The evaluation in ``eval.output_dir`` is not one of this candidate with these settings."""


def is_promotion_report(content: bytes) -> bool:
    """Whether ``content`` is a promotion report as :func:`promote` writes it."""
    try:
        report = json.loads(content)
    except ValueError:
        return False
    return isinstance(report, dict) and report.get("decision") in ("promoted", "rejected")


def evaluation_of_candidate(config: Config) -> tuple[dict, dict]:
    """``metrics.json`` and ``models.json`` of the evaluation in ``eval.output_dir``, checked to
    be an evaluation of ``train.output_dir``, scored by ``promote.check_reward`` when that guard
    is on: the gate decides on nothing else (an evaluation of another folder, or one whose check
    score came from another scorer, is :class:`StaleEvaluationError`)."""
    again = "; run `ppo evaluate` again with the same settings"
    read = {}
    for name in (EVAL_METRICS, EVAL_MODELS):
        path = Path(config.eval.output_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; run `ppo evaluate` first")
        try:
            read[name] = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise StaleEvaluationError(f"{path} is not valid JSON{again}") from None
        if not isinstance(read[name], dict):
            raise StaleEvaluationError(f"{path} is not a JSON object{again}")
    models = read[EVAL_MODELS]
    evaluated = models.get("candidate")
    if not isinstance(evaluated, str) or real_path(evaluated) != real_path(config.train.output_dir):
        raise StaleEvaluationError(
            f"{Path(config.eval.output_dir) / EVAL_MODELS} is an evaluation of "
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
    return read[EVAL_METRICS], models


def _check_reward_still_current(config: Config, trained: Any, judged: Any) -> None:
    """With ``model.reward=reward:current``, a :class:`StaleEvaluationError` when the candidate
    was trained (``training_summary.json``) or judged (``models.json``) against a reward
    version that is no longer the current one: a rollback or a newer version came since, and a
    policy trained on a withdrawn reward must not become production."""
    if config.model.reward != f"{REWARD_SPEC_PREFIX}current":
        return
    current = load_reward_registry(config.reward_model.versions_dir).get("current")
    now = f"{REWARD_SPEC_PREFIX}{current}" if current else "none"
    for what, spec in (("trained", trained), ("judged", judged)):
        if isinstance(spec, str) and spec.startswith(REWARD_SPEC_PREFIX) and spec != now:
            raise StaleEvaluationError(
                f"the candidate was {what} against the reward version {printable(spec)}, but "
                f"the current reward version is {now} (model.reward=reward:current; a rollback "
                "or a newer version came since): train and evaluate again against it, or set "
                f"model.reward={printable(spec)} to promote on the version it was {what} against"
            )


def promote(config: Config, code_version: dict[str, Any]) -> dict:
    """Apply the promotion gate to the evaluation in ``eval.output_dir``; on a pass, publish the
    candidate as a new production version. Writes the decision to ``promote.report`` either way
    and returns the registry entry; ``code_version`` (the commit that runs it) goes to the
    registry only."""
    rules = config.promote
    # Checked before anything is decided or published: the decision must be writable.
    check_replaceable_file(
        rules.report, "promote.report", "a promotion report", is_promotion_report
    )
    flat, models = evaluation_of_candidate(config)

    def side(name: str) -> dict[str, float] | None:
        return metric_group(flat, name) or None

    candidate = side("candidate")
    if candidate is None:
        raise ValueError(f"{Path(config.eval.output_dir) / EVAL_METRICS} has no candidate metrics")
    summary = read_training_summary(config.train.output_dir)
    _check_reward_still_current(config, summary.get("reward"), models.get("reward"))
    decision = gate(candidate, side("baseline"), rules, config.generation.max_new_tokens)
    config_file = Path(config.train.output_dir) / TRAINED_CONFIG
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
            "code_version": code_version,
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
