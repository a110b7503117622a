"""The files an evaluation writes (layer 3): ``metrics.json`` for ``dvc metrics``,
``models.json``, ``samples.json`` and ``report.md``, and the table ``ppo compare`` shows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ppo_core.config import Config
from ppo_core.evaluation.markdown import escape_markdown
from ppo_core.files import atomic_folder
from ppo_core.files.artifacts import EVAL_METRICS, EVAL_MODELS, EVAL_REPORT, EVAL_SAMPLES

__all__ = ["ModelReport", "RewardChoice", "markdown_report", "metric_table", "write_reports"]


@dataclass(frozen=True)
class RewardChoice:
    """The reward that scores an evaluation, and where that choice came from."""

    spec: str
    source: str
    """``eval.reward`` or ``model.reward``."""


@dataclass
class ModelReport:
    """Evaluation of one model."""

    name: str
    path: str
    metrics: dict[str, float]
    samples: list[dict[str, object]]
    unmeasured: dict[str, str] = field(default_factory=dict)
    """Metrics left out of ``metrics``, with why (``kl_to_reference`` of a baseline whose
    tokenizer is not the reference's)."""


def metric_table(reports: dict[str, ModelReport]) -> list[tuple[str, list[str]]]:
    """Rows ``(metric, [cell per model])`` for a table of ``reports``: numbers to 4 significant
    digits, ``n/a (why)`` where a model has no value."""
    keys = list(dict.fromkeys(key for r in reports.values() for key in (*r.metrics, *r.unmeasured)))
    return [
        (
            key,
            [
                f"{r.metrics[key]:.4g}"
                if key in r.metrics
                else f"n/a ({r.unmeasured.get(key, 'not measured')})"
                for r in reports.values()
            ],
        )
        for key in keys
    ]


def write_reports(
    reports: dict[str, ModelReport],
    folder: Path,
    config: Config,
    num_prompts: int,
    *,
    reward: RewardChoice,
    reference: str,
    origin: str | None = None,
    previous_reward: str | None = None,
) -> None:
    """``metrics.json`` (flat, for ``dvc metrics``; a metric a model lacks is absent),
    ``models.json`` (which folders were compared, the KL reference, the reward and the
    previous reward version that also scored them),
    ``samples.json`` and a Markdown report."""

    def write(tmp: Path) -> None:
        flat: dict[str, float | int] = {
            f"{name}/{key}": value
            for name, r in reports.items()
            for key, value in r.metrics.items()
        }
        if "baseline" in reports:
            for key in ("score", "accuracy"):  # accuracy: where rows carry answers
                if key in reports["baseline"].metrics and key in reports["candidate"].metrics:
                    flat[f"delta/{key}"] = (
                        reports["candidate"].metrics[key] - reports["baseline"].metrics[key]
                    )
        flat["num_prompts"] = num_prompts
        (tmp / EVAL_METRICS).write_text(json.dumps(flat, indent=1, sort_keys=True))
        described = {
            **{n: r.path for n, r in reports.items()},
            "reference": reference,
            "origin": origin or reference,
            "reward": reward.spec,
            "reward_source": reward.source,
            **({"previous_reward": previous_reward} if previous_reward else {}),
            **(
                {"check_reward": config.promote.check_reward}
                if config.promote.check_reward is not None
                else {}
            ),
        }
        (tmp / EVAL_MODELS).write_text(json.dumps(described, indent=1))
        (tmp / EVAL_SAMPLES).write_text(
            json.dumps({name: r.samples for name, r in reports.items()}, indent=1)
        )
        (tmp / EVAL_REPORT).write_text(
            markdown_report(
                reports, num_prompts, config, reward=reward, reference=reference, origin=origin
            )
        )

    atomic_folder(folder, write)


def markdown_report(
    reports: dict[str, ModelReport],
    num_prompts: int,
    config: Config,
    *,
    reward: RewardChoice,
    reference: str,
    origin: str | None = None,
) -> str:
    """The evaluation as Markdown. Every prompt, response, folder and reward name in it comes
    from users or models and goes through :func:`escape_markdown`."""
    names = list(reports)
    lines = [
        "# Evaluation",
        "",
        f"{num_prompts} held-out prompts x {config.eval.samples_per_prompt} samples, "
        f"temperature {config.generation.temperature}, top-k {config.generation.top_k}, "
        f"top-p {config.generation.top_p}, seed {config.eval.seed}, reward "
        f"{escape_markdown(reward.spec)} ({escape_markdown(reward.source)}), KL to the "
        f"reference {escape_markdown(reference)}"
        + (
            f", check score by {escape_markdown(config.promote.check_reward)} "
            "(promote.check_reward)."
            if config.promote.check_reward is not None
            else "."
        ),
        "",
        "Drift across generations: kl_to_origin and origin_nll measure against the first "
        f"model of the chain of production versions, {escape_markdown(origin or reference)}"
        " (the reference itself in a chain's first generation); promote.max_kl_from_origin "
        "bounds the first.",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    lines += [f"| {key} | " + " | ".join(cells) + " |" for key, cells in metric_table(reports)]
    if any(r.unmeasured for r in reports.values()):
        lines += [
            "",
            "A model with another tokenizer than the reference is sampled and decoded with its "
            "own tokenizer, so its score compares; its KL to the reference cannot be measured, and "
            "its response_length counts its own tokens.",
        ]
    for name in names:
        lines += ["", f"## Samples: {name} ({escape_markdown(reports[name].path)})", ""]
        lines += [
            f"- {escape_markdown(s['prompt'])} → **{escape_markdown(s['response'])}** "
            f"({s['score']:+.3f})"
            for s in reports[name].samples
        ]
    return "\n".join(lines) + "\n"
