"""The Prefect flow ``retrain``: the DVC stages in order, with retries, logs and artifacts.

Each task runs ``dvc repro --single-item <stage>`` in the repository, so the stage logic stays
in ``ppo <stage>`` and ``dvc.lock`` stays true: a stage whose inputs did not change is skipped, a
retried ``train`` resumes from its persisted checkpoints.

    python -m flows.pipeline run                 # one run now (temporary local Prefect server)
    python -m flows.pipeline serve               # deployments 'retrain/manual' and 'retrain/scheduled'
    prefect deployment run 'retrain/manual'      # with `serve` running and a Prefect server up
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from ppo_core.files import atomic_write_text

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

    from ppo_core.config import Config

STAGES = ("prepare", "base", "validate", "train", "evaluate", "promote")
# Stages worth retrying: the long, resumable ones. A validation failure is not retried.
RETRIED = {"train": 2, "evaluate": 1}


class StageFailed(RuntimeError):
    """A DVC stage exited with an error; the message carries the end of its output."""


def _environment() -> dict[str, str]:
    """PATH with this interpreter's bin folder first, so `dvc` and `ppo` are the project's."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@task(name="dvc-repro", task_run_name="{stage}")
def run_stage(stage: str, repo_dir: str) -> str:
    """Run ``dvc repro --single-item <stage>`` in ``repo_dir``; log its output; raise on failure.

    The flow runs the stages in DAG order, so the upstream ones are already up to date;
    ``--single-item`` spares each call re-checking (and re-hashing) all of them.
    """
    logger = get_run_logger()
    process = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "repro", "--single-item", stage],
        cwd=repo_dir,
        env=_environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    output = (process.stdout + process.stderr).strip()
    for line in output.splitlines()[-40:]:
        logger.info("[%s] %s", stage, line)
    if process.returncode != 0:
        tail = "\n".join(output.splitlines()[-15:])
        raise StageFailed(f"stage {stage} failed with exit code {process.returncode}:\n{tail}")
    return "skipped" if f"Stage '{stage}' didn't change" in output else "ran"


def set_params(repo_dir: str, updates: dict[str, Any]) -> None:
    """Set dotted keys in params.yaml, keeping its comments (as `dvc exp run -S` does); the file
    is replaced atomically."""
    from ruamel.yaml import YAML

    yaml = YAML()
    path = Path(repo_dir) / "params.yaml"
    data = yaml.load(path.read_text())
    for dotted, value in updates.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"params.yaml has no key {dotted!r}")
        node[leaf] = value
    text = io.StringIO()
    yaml.dump(data, text)
    atomic_write_text(path, text.getvalue())


def _load_params(repo_dir: str) -> Config:
    from ppo_core.config import load_config

    return load_config(Path(repo_dir) / "params.yaml")


def _production_version(repo_dir: str) -> str | None:
    from ppo_core.registry import current_production

    config = _load_params(repo_dir)
    registry = Path(repo_dir) / config.promote.registry
    production = current_production(registry, Path(repo_dir) / config.promote.production_dir)
    return None if production is None else str(production.relative_to(Path(repo_dir).resolve()))


@flow(name="retrain", log_prints=True)
def retrain(
    repo_dir: str = ".", from_production: bool = False, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Prepare, validate, train, evaluate and promote, each through `dvc repro`.

    Args:
        repo_dir: the project folder (holding dvc.yaml and params.yaml).
        from_production: start from the current production version (scheduled retraining);
            without one yet, from the configured base.
        params: extra dotted params.yaml updates for this run, e.g. {"ppo.epochs": 2}.
    """
    from ppo_core.files import exclusive_run

    repo_dir = str(Path(repo_dir).resolve())
    with exclusive_run(Path(repo_dir) / ".retrain.lock", "retraining run in this repository"):
        return _retrain(repo_dir, from_production, params)


def _retrain(repo_dir: str, from_production: bool, params: dict[str, Any] | None) -> dict[str, Any]:
    updates = dict(params or {})
    if from_production:
        version = _production_version(repo_dir)
        if version is not None:
            updates["base.source"] = version
        else:
            print("no production model yet: starting from the configured base")
    if updates:
        set_params(repo_dir, updates)
        print(f"params.yaml updated: {updates}")
    status = {}
    for stage in STAGES:
        runner = run_stage.with_options(retries=RETRIED.get(stage, 0), retry_delay_seconds=5)
        status[stage] = runner(stage, repo_dir)
    return publish_results(repo_dir, status)


def publish_results(repo_dir: str, status: dict[str, str]) -> dict[str, Any]:
    """Evaluation report and metrics as Prefect artifacts; returns where the outputs are (the
    paths of params.yaml, under ``repo_dir``)."""
    from flows.loggers import metric_group

    root = Path(repo_dir)
    config = _load_params(repo_dir)
    eval_dir = root / config.eval.output_dir
    report = eval_dir / "report.md"
    metrics_file = eval_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text())
    promotion = json.loads((root / config.promote.report).read_text())
    decision = promotion["decision"]
    header = (
        f"**Decision: {decision}**"
        + (f" as {promotion['version']}" if "version" in promotion else "")
        + "\n\n"
        + "\n".join(f"- {r}" for r in promotion["reasons"])
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
    outputs = {
        "stages": status,
        "decision": decision,
        "report": str(report),
        "metrics": str(metrics_file),
        "train_metrics": str(root / config.train.metrics_dir),
        "candidate": str(root / config.train.output_dir),
        "registry": str(root / config.promote.registry),
    }
    print("outputs: " + json.dumps(outputs, indent=1))
    return outputs


def serve_deployments(repo_dir: str = ".") -> None:
    """Serve 'retrain/manual' (on demand) and 'retrain/scheduled' (``schedule.cron`` in
    ``schedule.timezone``, from params.yaml)."""
    from prefect import serve

    manual, scheduled = deployments(repo_dir)
    # One run at a time: a schedule firing during a manual run waits instead of racing it for
    # the same workspace (DVC would refuse the second `dvc repro` on its lock anyway).
    serve(manual, scheduled, limit=1)


def deployments(repo_dir: str = ".") -> tuple[RunnerDeployment, RunnerDeployment]:
    """The deployments 'retrain/manual' and 'retrain/scheduled' of the project in ``repo_dir``."""
    from prefect.schedules import Cron

    config = _load_params(repo_dir)
    repo = str(Path(repo_dir).resolve())
    when = config.schedule
    manual = retrain.to_deployment(
        name="manual", parameters={"repo_dir": repo}, description="Run the whole pipeline now."
    )
    scheduled = retrain.to_deployment(
        name="scheduled",
        schedule=Cron(when.cron, timezone=when.timezone),
        parameters={"repo_dir": repo, "from_production": True},
        description=f"Retrain on new data from the production model ({when.cron}, "
        f"{when.timezone}).",
    )
    # to_deployment returns a coroutine only when it is called from async code.
    return cast("RunnerDeployment", manual), cast("RunnerDeployment", scheduled)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m flows.pipeline", description="Run or serve the Prefect flow 'retrain'."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run the flow once now")
    run_parser.add_argument("--repo", default=".")
    run_parser.add_argument("--from-production", action="store_true")
    serve_parser = sub.add_parser("serve", help="serve the manual and scheduled deployments")
    serve_parser.add_argument("--repo", default=".")
    args = parser.parse_args(argv)
    if args.command == "run":
        outputs = retrain(repo_dir=args.repo, from_production=args.from_production)
        print(
            f"report: {outputs['report']}\nmetrics: {outputs['metrics']}\n"
            f"model: {outputs['candidate']}\nregistry: {outputs['registry']} "
            f"(decision: {outputs['decision']})"
        )
    else:
        serve_deployments(args.repo)


if __name__ == "__main__":
    main()
