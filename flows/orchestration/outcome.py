"""What a run of the flow decided and where it shows: the one-line decision, the outputs the
flow returns, the Prefect artifacts (evaluation report and metrics, a validation failure), the
decision event, and the summary at the end of ``python -m flows.pipeline run``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

from flows.ingest import Taken, set_aside_rejected
from flows.orchestration.project import load_params, production_version, stays
from ppo_core.evaluation.markdown import escape_markdown
from ppo_core.files.artifacts import EVAL_METRICS, EVAL_REPORT, metric_group


def decision_message(
    promotion: dict[str, Any], production: str | None, decided: bool = True
) -> str:
    """One line: the version this run promoted, or why it rejected the candidate, or that it
    had nothing to decide (``decided`` false: the promote stage was skipped), and then which
    production version (``production``, its folder) stays in place."""
    staying = stays(production)
    if not decided:
        return f"nothing changed since the last decision ({promotion['decision']}); {staying}"
    if promotion["decision"] == "promoted":
        return f"promoted as {promotion['version']}: {promotion['path']}"
    failed = [r.removeprefix("FAIL: ") for r in promotion["reasons"] if r.startswith("FAIL")]
    return f"{promotion['decision']} ({'; '.join(failed)}); {staying}"


def nothing_new(repo_dir: str) -> dict[str, Any]:
    """The outputs of a ``new_data_only`` run that found no new data."""
    production = production_version(repo_dir)
    return {
        "stages": {},
        "decision": None,
        "decided": False,
        "version": None,
        "production": None if production is None else str(Path(repo_dir) / production),
        "reasons": [],
        "message": f"no new data since the prepared version; nothing to do; {stays(production)}",
    }


def publish_results(repo_dir: str, status: dict[str, str]) -> dict[str, Any]:
    """Evaluation report and metrics as Prefect artifacts; returns where the outputs are (the
    paths of params.yaml, under ``repo_dir``) and the promotion decision."""

    root = Path(repo_dir)
    config = load_params(repo_dir)
    eval_dir = root / config.eval.output_dir
    report = eval_dir / EVAL_REPORT
    metrics_file = eval_dir / EVAL_METRICS
    metrics = json.loads(metrics_file.read_text())
    promotion = json.loads((root / config.promote.report).read_text())
    decision = promotion["decision"]
    # The reasons quote folder and model names: markup in them shows as text, not as links.
    header = (
        f"**Decision: {escape_markdown(decision)}**"
        + (f" as {escape_markdown(promotion['version'])}" if "version" in promotion else "")
        + "\n\n"
        + "\n".join(f"- {escape_markdown(r)}" for r in promotion["reasons"])
        + "\n\n"
    )
    create_markdown_artifact(
        markdown=header + report.read_text(),
        key="evaluation-report",
        description="Held-out evaluation and promotion decision",
    )
    sides = {side: metric_group(metrics, side) for side in ("candidate", "baseline")}
    names = sorted(set().union(*sides.values()))
    table = [
        {"metric": name, **{side: values.get(name) for side, values in sides.items()}}
        for name in names
    ]
    create_table_artifact(
        table=table, key="evaluation-metrics", description="candidate vs baseline"
    )
    # A skipped promote stage left the last run's report: this run decided nothing.
    decided = status.get("promote") != "skipped"
    promoted = decided and decision == "promoted"
    production = promotion["path"] if promoted else production_version(repo_dir)
    outputs = {
        "stages": status,
        "decision": decision,
        "decided": decided,
        "version": promotion["version"] if promoted else None,
        "production": None if production is None else str(root / production),
        "reasons": promotion["reasons"],
        "message": decision_message(promotion, production, decided),
        "report": str(report),
        # what leaves the machine (the decision's event, the notifications) names paths in the
        # project, not where the project lies on this machine
        "shared": {
            "production": None if production is None else str(production),
            "report": str(Path(config.eval.output_dir) / EVAL_REPORT),
            "registry": str(config.promote.registry),
        },
        "metrics": str(metrics_file),
        "train_metrics": str(root / config.train.metrics_dir),
        "candidate": str(root / config.train.output_dir),
        "registry": str(root / config.promote.registry),
    }
    print("outputs: " + json.dumps(outputs, indent=1))
    return outputs


def announce_decision(outputs: dict[str, Any]) -> None:
    """The decision as a Prefect event related to the flow run, ``ppo.candidate.promoted``
    (``rejected``; ``unchanged`` when the promote stage was skipped), named by its message.

    `prefect deployment run --watch` shows a run's events from any server but its logs only from
    one that streams them out (PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED, off by default), and ends
    with the final state's name, which stays "Completed" so that automations on completed runs
    keep firing: this event is what shows the decision there. Automations can act on it too.
    """

    outcome = outputs["decision"] if outputs["decided"] else "unchanged"
    shared = outputs.get("shared", {})
    emit_event(
        event=f"ppo.candidate.{outcome}",
        resource={
            "prefect.resource.id": f"ppo.registry.{shared.get('registry', outputs['registry'])}",
            "prefect.resource.name": outputs["message"],
        },
        payload={
            key: shared.get(key, outputs.get(key))
            for key in ("decision", "decided", "version", "production", "reasons", "report")
        },
    )


def reject_ingested(repo_dir: str, taken: Taken, failure: str, stage: str = "validate") -> str:
    """``stage`` (prepare or validate) failed on data that holds files this run took from the
    inboxes: set them all aside (``ingest.rejected_dir``; prompt and feedback files alike, with
    the reason) so that the raw and the feedback folder are again the ones the prepared version
    was made from and the next run is not stopped by them, publish the failure as the artifact
    ``<stage>-failure``, and return the run's error message."""

    config = load_params(repo_dir)
    with contextlib.chdir(repo_dir):
        folder = set_aside_rejected(config, taken.prompts, failure, taken.feedback)
    names = ", ".join(taken.names())
    verb = "Validation rejected" if stage == "validate" else f"`{stage}` failed on"
    lines = [
        f"**{verb} the data with the ingested files {escape_markdown(names)}**",
        "",
        f"They were moved to `{escape_markdown(str(folder))}`; the prepared data, the production "
        f"model and the registry are unchanged. The {stage} stage said:",
        "",
        "```",
        failure.replace("`", "'"),
        "```",
    ]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key=f"{'validation' if stage == 'validate' else stage}-failure",
        description=f"What the {stage} stage refused in the ingested data",
    )
    return (
        f"{failure}\nThe ingested files {names} were set aside in {folder}; the "
        "prepared data and production are unchanged"
    )


def summary(outputs: dict[str, Any]) -> str:
    """What a run of the flow made and decided, for the end of `python -m flows.pipeline run`."""
    lines = [
        f"report:     {outputs['report']}",
        f"metrics:    {outputs['metrics']}",
        f"candidate:  {outputs['candidate']}",
        f"registry:   {outputs['registry']}",
    ]
    production = outputs["production"] or "none yet"
    if not outputs["decided"]:
        lines.append(f"production: {production} (stays: nothing changed since the last run)")
    elif outputs["decision"] == "promoted":
        lines.append(f"production: {production} (promoted as {outputs['version']} by this run)")
    else:
        lines.append(f"production: {production} (stays: the candidate was rejected)")
        lines += [f"  {reason}" for reason in outputs["reasons"]]
    lines.append(f"decision:   {outputs['message']}")
    return "\n".join(lines)
