"""Experiments side by side: what ``dvc exp show`` records, cut to what a person compares.

``dvc exp show`` lists every param and metric; the headline of a PPO run is a handful of held-out
numbers beside the params that differ between the runs. :func:`compare_runs` reads
``dvc exp show --json`` and returns exactly that, for ``ppo compare`` to print.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HEADLINE",
    "TASK_HEADLINE",
    "Comparison",
    "Run",
    "compare_runs",
    "headline",
    "parse_exp_show",
]

# (flattened metric key, short column title): the held-out evaluation of the candidate and the
# training speed.
HEADLINE = (
    ("candidate/score", "score"),
    ("candidate/positive_rate", "positive"),
    ("candidate/kl_to_reference", "KL"),
    ("candidate/kl_to_origin", "KL origin"),
    ("candidate/eos_rate", "EOS"),
    ("candidate/distinct_2", "distinct-2"),
    ("perf.tokens_per_s", "tokens/s"),
)

# Columns shown when a run has them: the task's held-out accuracy, where rows carry answers.
TASK_HEADLINE = (("candidate/accuracy", "accuracy"), ("delta/accuracy", "accuracy gain"))


@dataclass(frozen=True)
class Run:
    """One row of ``dvc exp show``: the workspace, a commit, or an experiment."""

    name: str
    params: dict[str, Any]
    metrics: dict[str, float]


@dataclass(frozen=True)
class Comparison:
    runs: list[Run]
    changed: list[str]
    """Param keys whose value is not the same in every run, in the order of params.yaml."""

    @property
    def columns(self) -> list[tuple[str, str]]:
        """:data:`HEADLINE`, then each of :data:`TASK_HEADLINE` that some run has."""
        return headline(self.runs)


def headline(runs: list[Run]) -> list[tuple[str, str]]:
    """The metric columns for ``runs``: :data:`HEADLINE`, then the task columns some run has."""
    present = {key for run in runs for key in run.metrics}
    return [*HEADLINE, *(column for column in TASK_HEADLINE if column[0] in present)]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _run(entry: dict[str, Any], name: str) -> Run:
    data = entry.get("data") or {}
    params: dict[str, Any] = {}
    for source in (data.get("params") or {}).values():
        params.update(_flatten(source.get("data") or {}))
    metrics: dict[str, float] = {}
    for source in (data.get("metrics") or {}).values():
        for key, value in _flatten(source.get("data") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[key] = float(value)
    return Run(name=name, params=params, metrics=metrics)


def parse_exp_show(payload: list[dict[str, Any]]) -> list[Run]:
    """The rows of ``dvc exp show --json`` (DVC 3): each baseline commit (and the workspace),
    followed by its experiments."""
    runs = []
    for baseline in payload:
        runs.append(_run(baseline, _name(baseline)))
        for experiment in baseline.get("experiments") or []:
            runs.extend(_run(entry, _name(entry)) for entry in experiment.get("revs") or [])
    return runs


def _name(entry: dict[str, Any]) -> str:
    """The branch or experiment name; else the short commit (``workspace`` stays whole)."""
    rev = str(entry.get("rev", "?"))
    return entry.get("name") or (rev if rev == "workspace" else rev[:7])


# `dvc exp show` reads git and DVC's cache only; far longer than this means it is stuck.
EXP_SHOW_TIMEOUT_S = 600


def compare_runs(repo: str | Path = ".", all_commits: bool = False) -> Comparison:
    """Read the experiments of ``repo`` with ``dvc exp show --json``.

    Raises:
        RuntimeError: ``dvc exp show`` failed; the message carries DVC's own error line.
    """
    dvc = Path(sys.executable).parent / "dvc"
    command = [str(dvc) if dvc.exists() else "dvc", "exp", "show", "--json"]
    if all_commits:
        command.append("--all-commits")
    try:
        done = subprocess.run(
            command,
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
            timeout=EXP_SHOW_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"dvc exp show did not finish within {EXP_SHOW_TIMEOUT_S} s and was stopped"
        ) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"dvc exp show failed: {lines[-1] if lines else done.returncode}")
    runs = parse_exp_show(json.loads(done.stdout or "[]"))
    keys = list(dict.fromkeys(key for run in runs for key in run.params))
    changed = [key for key in keys if len({repr(run.params.get(key)) for run in runs}) > 1]
    return Comparison(runs=runs, changed=changed)


def format_number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
