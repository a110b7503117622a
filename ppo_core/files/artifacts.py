"""The files the stages leave for each other, named once: who writes each, who reads it, and the
readers every consumer shares.

| name | written by | in | read by |
|---|---|---|---|
| ``manifest.json`` | ``prepare`` (and the feedback's pair version) | ``data.interim_dir``, ``data.prepared_dir`` | ``validate``, ``train``, ``reward``, ``ppo prepare`` |
| ``summary.json`` | ``validate`` | ``validation.report_dir`` | people, the pipeline's outcome |
| ``validated_with.json`` | ``validate`` (on publishing) | ``data.prepared_dir`` | ``train``, ``evaluate`` (the prompt token bound the data was held to) |
| ``imported_from.json`` | ``base`` (an import) | ``model.policy`` | lineage, ``promote`` |
| ``tiny_default.json`` | ``base`` (the tiny default) | ``model.policy`` | people |
| ``training_summary.json`` | ``train`` | ``train.output_dir`` | ``evaluate`` (the reward it trained with), ``promote`` (data hash, base, seed) |
| ``ppo_config.yaml`` | ``train`` | ``train.output_dir`` | ``evaluate``, ``promote`` (the registry keeps it) |
| ``metrics.json`` | ``evaluate`` (flat ``candidate/*``, ``baseline/*``, ``delta/*``), ``reward`` | ``eval.output_dir``, ``reward.report_dir`` | ``promote``, the flow's outcome |
| ``models.json`` | ``evaluate`` | ``eval.output_dir`` | ``promote`` (is it this candidate's evaluation?) |
| ``report.md``, ``samples.json`` | ``evaluate`` | ``eval.output_dir`` | people |
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_MANIFEST",
    "EVAL_METRICS",
    "EVAL_MODELS",
    "EVAL_REPORT",
    "EVAL_SAMPLES",
    "IMPORT_RECORD",
    "TINY_DEFAULT_RECORD",
    "TRAINED_CONFIG",
    "TRAINING_SUMMARY",
    "VALIDATION_RECORD",
    "VALIDATION_SUMMARY",
    "metric_group",
    "read_training_summary",
]

DATA_MANIFEST = "manifest.json"
VALIDATION_SUMMARY = "summary.json"
VALIDATION_RECORD = "validated_with.json"
IMPORT_RECORD = "imported_from.json"
TINY_DEFAULT_RECORD = "tiny_default.json"
TRAINING_SUMMARY = "training_summary.json"
TRAINED_CONFIG = "ppo_config.yaml"
EVAL_METRICS = "metrics.json"
EVAL_MODELS = "models.json"
EVAL_REPORT = "report.md"
EVAL_SAMPLES = "samples.json"


def read_training_summary(candidate_dir: str | Path) -> dict[str, Any]:
    """The ``training_summary.json`` of a trained candidate; ``{}`` for a folder without one (a
    model folder that no ``ppo train`` wrote)."""
    path = Path(candidate_dir) / TRAINING_SUMMARY
    return json.loads(path.read_text()) if path.is_file() else {}


def metric_group(flat: Mapping[str, float], group: str) -> dict[str, float]:
    """The metrics ``{group}/{name}`` of ``flat`` as ``{name: value}``, e.g. the ``candidate``
    side of the ``metrics.json`` written by ``ppo evaluate``."""
    prefix = f"{group}/"
    return {key[len(prefix) :]: value for key, value in flat.items() if key.startswith(prefix)}
