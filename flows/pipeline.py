"""The Prefect flow ``retrain``: the DVC stages in order, with retries, timeouts, logs and
artifacts.

Each task runs ``dvc repro --single-item <stage>`` in the project (through one DVC process a
run, :mod:`flows.dvc_session`), so the stage logic stays in ``ppo <stage>`` and ``dvc.lock``
stays true: a stage whose inputs did not change is skipped, a retried ``train`` resumes from its
persisted checkpoints.

    python -m flows.pipeline run                 # one run now (its own local Prefect server)
    python -m flows.pipeline serve               # the deployments of prefect.yaml, no work pool
    prefect --no-prompt deploy --all             # the same for a work pool (see prefect.yaml)
    prefect deployment run 'retrain/manual'      # with a Prefect server up

The project a run works on is fixed where the flow is served (:data:`PROJECT_ENV`), never a
run parameter; a run's ``params`` are held to an allow-list (:mod:`flows.run_params`).
"""

from __future__ import annotations

import sys

# The project folder of every run of the flow in this process and the runs it starts: set by
# `serve` (or the deployment's environment) from the folder it was given; the working folder
# when unset. A run cannot choose it, so it cannot point the flow at another `dvc.yaml`.
PROJECT_ENV = "PPO_PROJECT_DIR"

if __name__ == "__main__":
    # `python -m flows.pipeline run`: start the run's own Prefect server (when none is named)
    # and its DVC process before the imports below, so that they import at the same time as
    # this process does.
    from flows.dvc_session import run_folder, start_ahead
    from flows.local_server import start_if_needed
    from flows.relay import stage_environment

    _early_server = start_if_needed(sys.argv[1:])
    _folder = run_folder(sys.argv[1:])
    if _folder is not None:
        start_ahead(_folder, stage_environment() | {PROJECT_ENV: _folder})

import contextlib
import json
import os
import shlex
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed

from flows.dvc_session import DvcSession
from flows.dvc_session import take as take_session
from flows.relay import CommandTimedOut, StageRelay, stage_environment
from flows.run_params import check_run_params, params_for_this_run, put_back_left_params

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.deployments.runner import RunnerDeployment
    from prefect.states import State
    from prefect.tasks import Task

    from flows.local_server import LocalServer
    from flows.records import DvcRunner
    from ppo_core.config import Config

STAGES = ("prepare", "base", "validate", "train", "evaluate", "promote")
# Stages that run the models (on the accelerator, when there is one): they hold a slot of
# flow.gpu_limit while they run.
ACCELERATED = ("train", "evaluate")
# Stages worth retrying: the long, resumable ones. A validation failure is not retried.
RETRIED = {"train": 2, "evaluate": 1}


class StageFailed(RuntimeError):
    """A DVC stage exited with an error; the message carries the end of its output."""


class StageTimedOut(StageFailed):
    """A DVC stage ran past its ``flow.<stage>_timeout`` and was stopped; never retried."""


def project_dir() -> Path:
    """The project folder runs of the flow work in: ``$PPO_PROJECT_DIR``, else the working
    folder; resolved.

    Raises:
        RunParamsError: this run's own job variables set ``PPO_PROJECT_DIR``: a run request to a
            work pool may override the deployment's environment, but not move its project."""
    from prefect.runtime import flow_run

    from flows.run_params import RunParamsError

    requested = (flow_run.get_job_variables() or {}).get("env") or {}
    if isinstance(requested, dict) and PROJECT_ENV in requested:
        raise RunParamsError(
            f"job_variables: {PROJECT_ENV} cannot be set by a flow run; the project folder is "
            "fixed where the deployment is defined (prefect.yaml) or served"
        )
    return Path(os.environ.get(PROJECT_ENV) or ".").resolve()


# The DVC process of each project's running flow (:mod:`flows.dvc_session`), shared by its
# stages; a stage task called on its own starts one for itself.
_SESSIONS: dict[str, DvcSession] = {}


@contextlib.contextmanager
def _dvc_session(repo_dir: str) -> Iterator[DvcSession]:
    if repo_dir in _SESSIONS:
        yield _SESSIONS[repo_dir]
    else:
        with DvcSession(repo_dir, stage_environment()) as session:
            yield session


@contextlib.contextmanager
def stage_session(repo_dir: str) -> Iterator[None]:
    """One DVC process for the stages and records of this run, started now (or taken from
    :func:`flows.dvc_session.start_ahead`), so that it imports DVC while the run takes its new
    data and the first task is set up."""
    session = take_session(repo_dir, stage_environment())
    _SESSIONS[repo_dir] = session
    try:
        yield
    except BaseException:
        del _SESSIONS[repo_dir]
        session.close()
        raise
    del _SESSIONS[repo_dir]
    # Idle, its process ends by itself once its input is closed (about 1 s): the run goes on.
    threading.Thread(target=session.close, daemon=True).start()


def _retry_unless_timed_out(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """A stage over its time limit has used its budget: retrying it would hold the retraining
    lock for that long again."""
    return not isinstance(state.data, StageTimedOut)


@task(name="dvc-repro", task_run_name="{stage}", retry_condition_fn=_retry_unless_timed_out)
def run_stage(stage: str, repo_dir: str, timeout: float = 0.0) -> dict[str, Any]:
    """Run ``dvc repro --single-item <stage>`` in ``repo_dir``; log its output as it comes;
    raise on failure, or after ``timeout`` seconds (0: no limit) with every process of the stage
    stopped. Returns ``{"status": "ran" | "skipped", "to_track": [files]}``, the files DVC asks
    to `git add`.

    The flow runs the stages in DAG order, so the upstream ones are already up to date;
    ``--single-item`` spares each call re-checking (and re-hashing) all of them.
    """
    logger = get_run_logger()
    # `stage | line`, not `[stage] line`: `prefect deployment run --watch` prints log messages
    # as Rich markup, in which `[stage]` is a tag and vanishes.
    relay = StageRelay(
        stage, lambda level, text: logger.log(level, "%s | %s", stage, text), repo_dir
    )
    try:
        with _dvc_session(repo_dir) as session:
            returncode = session.run(["repro", "--single-item", stage], relay, timeout)
    except CommandTimedOut as stopped:
        raise StageTimedOut(
            f"stage {stage} ran longer than flow.{stage}_timeout ({stopped.seconds:g} s) and was "
            "stopped with every process it started; it is not retried. Raise flow."
            f"{stage}_timeout in params.yaml if the stage needs longer"
            + (": a rerun resumes from its last checkpoint" if stage == "train" else "")
        ) from None
    if returncode != 0:
        tail = "\n".join(relay.tail)
        raise StageFailed(f"stage {stage} failed with exit code {returncode}:\n{tail}")
    return {"status": "skipped" if relay.skipped else "ran", "to_track": relay.to_track}


# The config of each project's params.yaml with the text it was built from: a run reads it at
# every step, and building it (OmegaConf's merge and the checks) takes 0.1-0.6 s each time.
_PARAMS: dict[Path, tuple[str, Config]] = {}


def _load_params(repo_dir: str) -> Config:
    """The config of ``repo_dir``'s ``params.yaml``, built again only when the file's text
    changed (a run's own values come and go, :func:`flows.run_params.params_for_this_run`).
    One object is shared by its callers: read it, never change it."""
    from ppo_core.config import load_config

    path = Path(repo_dir) / "params.yaml"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return load_config(path)  # its error names the file and the problem
    cached = _PARAMS.get(path)
    if cached is not None and cached[0] == text:
        return cached[1]
    config = load_config(path)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.read_text() == text:  # not changed while it was read
            _PARAMS[path] = (text, config)
    return config


def _production_version(repo_dir: str) -> str | None:
    from ppo_core.registry import current_production

    config = _load_params(repo_dir)
    registry = Path(repo_dir) / config.promote.registry
    production = current_production(registry, Path(repo_dir) / config.promote.production_dir)
    return None if production is None else str(production.relative_to(Path(repo_dir).resolve()))


@flow(name="retrain", log_prints=True)
def retrain(
    from_production: bool = False,
    params: dict[str, Any] | None = None,
    new_data_only: bool = False,
    backup: bool = False,
    restart_limit: int = 0,
) -> dict[str, Any]:
    """Prepare, validate, train, evaluate and promote, each through `dvc repro`, in the project
    folder fixed where the flow is served (``$PPO_PROJECT_DIR``, else the working folder).

    A run waits for the project's retraining lock while another run holds it, then moves the
    files ``ppo ingest`` left in ``ingest.inbox_dir`` into ``data.raw_dir`` (:mod:`flows.ingest`).

    Args:
        from_production: start from the current production version (scheduled retraining);
            without one yet, from the configured base.
        params: training settings for this run only, e.g. ``{"ppo.epochs": 2}``: only the keys
            of ``flows.run_params.RUN_PARAMS``, checked before anything is written, and held in
            ``params.yaml`` only while the run lasts.
        new_data_only: end at once, running no stage, when the raw prompts are those of the
            prepared version (the deployment ``retrain/on-new-data``: a run triggered for files
            that an earlier run already took has nothing to do).
        backup: after a decision, back the production versions and the registry up in the DVC
            remote (:func:`flows.records.back_up_production`); the deployments of
            ``prefect.yaml`` do.
        restart_limit: set by each deployment's trigger on its crashed runs (``prefect.yaml``):
            this run restarts one that crashed, and fails at once, running nothing, when the
            deployment's last ``restart_limit`` runs all crashed (:mod:`flows.restarts`).

    Every run that reaches a decision is recorded as a DVC experiment
    (:func:`flows.records.save_experiment`).
    """
    from ppo_core.files import exclusive_run

    if restart_limit:
        from prefect.runtime import deployment

        from flows.restarts import check_restart

        check_restart(restart_limit, deployment.id, deployment.name or "")
    repo_dir = str(project_dir())
    updates = check_run_params(repo_dir, params)
    with (
        exclusive_run(
            Path(repo_dir) / ".retrain.lock", "retraining run in this repository", on_wait=_waiting
        ),
        stage_session(repo_dir),
    ):
        left = put_back_left_params(repo_dir)
        if left:
            print(left)
        taken, new_data = _take_new_data(repo_dir)
        if new_data_only and not new_data:
            outputs = nothing_new(repo_dir)
            print(f"decision: {outputs['message']}")
            return cast("dict[str, Any]", Completed(message=outputs["message"], data=outputs))
        if from_production:
            version = _production_version(repo_dir)
            if version is not None:
                updates["base.source"] = version
            else:
                print("no production model yet: starting from the configured base")
        if updates:
            print(f"params.yaml holds this run's values until it ends: {updates}")
        with params_for_this_run(repo_dir, updates):
            outputs = _retrain(repo_dir, updates, taken, backup)
    # A returned state is the run's final state: its message, the decision, shows in the UI, in
    # `prefect flow-run inspect` and in the run's last log line ("Finished in state
    # Completed('promoted as ...')"); callers of the flow get its data, the outputs.
    return cast("dict[str, Any]", Completed(message=outputs["message"], data=outputs))


@contextlib.contextmanager
def accelerator_slot(limit: str) -> Iterator[None]:
    """Hold one slot of the Prefect global concurrency limit ``limit`` (``flow.gpu_limit``) for
    the duration, waiting for one while they are all taken; without a limit of that name (or
    with an empty name), hold nothing."""
    from prefect import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    if limit:
        with get_client(sync_client=True) as client:
            try:
                client.read_global_concurrency_limit_by_name(limit)
            except ObjectNotFound:
                limit = ""
    if not limit:
        yield
        return
    print(f"taking a slot of the concurrency limit {limit!r} (flow.gpu_limit)")
    with concurrency(limit, occupy=1):
        yield


def _waiting(holder: str) -> None:
    print(f"{holder}: this run waits for it to end")


def _take_new_data(repo_dir: str) -> tuple[list[str], list[str]]:
    """Move the ingested files into the raw folder; returns their names and how the raw folder
    now differs from the prepared version (``flows.stages.raw_changes``)."""
    from flows.ingest import take_inbox
    from flows.stages import raw_changes

    config = _load_params(repo_dir)
    with contextlib.chdir(repo_dir):
        taken = take_inbox(config)
        changes = raw_changes(config)
    if taken:
        print(f"took {len(taken)} ingested file(s) into {config.data.raw_dir}: {', '.join(taken)}")
    return taken, changes


def nothing_new(repo_dir: str) -> dict[str, Any]:
    """The outputs of a ``new_data_only`` run that found no new data."""
    production = _production_version(repo_dir)
    return {
        "stages": {},
        "decision": None,
        "decided": False,
        "version": None,
        "production": None if production is None else str(Path(repo_dir) / production),
        "reasons": [],
        "message": f"no new data since the prepared version; nothing to do; {_stays(production)}",
    }


def _retrain(
    repo_dir: str, updates: dict[str, Any], taken: list[str], backup: bool
) -> dict[str, Any]:
    status, to_track = _run_stages(repo_dir, taken)
    outputs = publish_results(repo_dir, status)
    to_track += keep_records(repo_dir, backup and outputs["decided"])
    if to_track:
        files = shlex.join(to_track)
        print(
            f"{files} changed: `git add {files}` records this run in git; `dvc push` stores "
            "its outputs in the DVC remote"
        )
    if updates:
        print(
            f"dvc.lock records this run's values ({', '.join(updates)}) and params.yaml goes "
            "back to its own: the next run without them trains again"
        )
    # Last, so that it ends the run's log.
    print(f"decision: {outputs['message']}")
    announce_decision(outputs)
    return outputs


def _run_stages(repo_dir: str, taken: list[str]) -> tuple[dict[str, str], list[str]]:
    """Each stage as a task, in order; returns each stage's status and the files DVC asks to
    `git add`."""
    timeouts = _load_params(repo_dir).flow  # and flow.gpu_limit
    status = {}
    to_track: list[str] = []
    for stage in STAGES:
        runner = run_stage.with_options(retries=RETRIED.get(stage, 0), retry_delay_seconds=5)
        slot = accelerator_slot(timeouts.gpu_limit) if stage in ACCELERATED else nullcontext()
        try:
            with slot:
                result = runner(stage, repo_dir, getattr(timeouts, f"{stage}_timeout"))
        except StageFailed as failed:
            if stage == "validate" and taken and not isinstance(failed, StageTimedOut):
                raise StageFailed(reject_ingested(repo_dir, taken, str(failed))) from None
            raise
        status[stage] = result["status"]
        to_track += [f for f in result["to_track"] if f not in to_track]
    return status, to_track


def announce_decision(outputs: dict[str, Any]) -> None:
    """The decision as a Prefect event related to the flow run, ``ppo.candidate.promoted``
    (``rejected``; ``unchanged`` when the promote stage was skipped), named by its message.

    `prefect deployment run --watch` shows a run's events from any server but its logs only from
    one that streams them out (PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED, off by default), and ends
    with the final state's name, which stays "Completed" so that automations on completed runs
    keep firing: this event is what shows the decision there. Automations can act on it too.
    """
    from prefect.events import emit_event

    outcome = outputs["decision"] if outputs["decided"] else "unchanged"
    emit_event(
        event=f"ppo.candidate.{outcome}",
        resource={
            "prefect.resource.id": f"ppo.registry.{outputs['registry']}",
            "prefect.resource.name": outputs["message"],
        },
        payload={
            key: outputs[key] for key in ("decision", "decided", "version", "production", "reasons")
        },
    )


def keep_records(repo_dir: str, backup: bool) -> list[str]:
    """Back production and the registry up (with ``backup``), then record the run as a DVC
    experiment named after the flow run, the backup's pointers included; log each outcome.
    Returns the pointer files to commit with git."""
    from prefect.runtime import flow_run

    from flows.records import back_up_production, experiment_name, pointer_files, save_experiment

    config = _load_params(repo_dir)
    run = _in_session(repo_dir)
    if backup:
        print(back_up_production(repo_dir, config, run).message)
    pointers = [p for p in pointer_files(config) if (Path(repo_dir) / p).is_file()]
    name = experiment_name(flow_run.name or "run")
    # `dvc repro` cached each stage's outputs as it ran: the record caches only the last stage
    # again (an empty list would hash and cache every stage's outputs a second time).
    print(save_experiment(repo_dir, name, pointers, run, stages=[STAGES[-1]]).message)
    return pointers if backup else []


def _in_session(repo_dir: str) -> DvcRunner:
    """A :data:`flows.records.DvcRunner` that sends each command to this run's DVC process (a
    new one when there is none), so that it does not import DVC again."""

    def run(args: Sequence[str], timeout: float) -> tuple[int, str]:
        relay = StageRelay("dvc", lambda level, text: None, repo_dir)
        try:
            with _dvc_session(repo_dir) as session:
                code = session.run(list(args), relay, timeout)
        except CommandTimedOut as stopped:
            command = " ".join(args)
            return 124, f"`dvc {command}` ran longer than {stopped.seconds:g} s and was stopped"
        return code, "\n".join(relay.tail)

    return run


def reject_ingested(repo_dir: str, taken: list[str], failure: str) -> str:
    """Validation rejected data that holds files this run took from the inbox: set them aside
    (``ingest.rejected_dir``) so that the raw folder is again the one the prepared version was
    made from, publish the failed expectations as the artifact ``validation-failure``, and
    return the run's error message."""
    from flows.ingest import set_aside_rejected
    from ppo_core.markdown import escape_markdown

    config = _load_params(repo_dir)
    with contextlib.chdir(repo_dir):
        folder = set_aside_rejected(config, taken, failure)
    lines = [
        f"**Validation rejected the data with the ingested files {escape_markdown(', '.join(taken))}**",
        "",
        f"They were moved to `{escape_markdown(str(folder))}`; the prepared data, the production "
        "model and the registry are unchanged. The validate stage said:",
        "",
        "```",
        failure.replace("`", "'"),
        "```",
    ]
    create_markdown_artifact(
        markdown="\n".join(lines),
        key="validation-failure",
        description="Expectations the ingested data failed",
    )
    return (
        f"{failure}\nThe ingested files {', '.join(taken)} were set aside in {folder}; the "
        "prepared data and production are unchanged"
    )


def _stays(production: str | None) -> str:
    """Which production version stays in place (``production``, its folder)."""
    if not production:
        return "no production model yet"
    return f"production stays {Path(production).name}: {production}"


def decision_message(
    promotion: dict[str, Any], production: str | None, decided: bool = True
) -> str:
    """One line: the version this run promoted, or why it rejected the candidate, or that it
    had nothing to decide (``decided`` false: the promote stage was skipped), and then which
    production version (``production``, its folder) stays in place."""
    stays = _stays(production)
    if not decided:
        return f"nothing changed since the last decision ({promotion['decision']}); {stays}"
    if promotion["decision"] == "promoted":
        return f"promoted as {promotion['version']}: {promotion['path']}"
    failed = [r.removeprefix("FAIL: ") for r in promotion["reasons"] if r.startswith("FAIL")]
    return f"{promotion['decision']} ({'; '.join(failed)}); {stays}"


def publish_results(repo_dir: str, status: dict[str, str]) -> dict[str, Any]:
    """Evaluation report and metrics as Prefect artifacts; returns where the outputs are (the
    paths of params.yaml, under ``repo_dir``) and the promotion decision."""
    from flows.loggers import metric_group
    from ppo_core.markdown import escape_markdown

    root = Path(repo_dir)
    config = _load_params(repo_dir)
    eval_dir = root / config.eval.output_dir
    report = eval_dir / "report.md"
    metrics_file = eval_dir / "metrics.json"
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
    production = promotion["path"] if promoted else _production_version(repo_dir)
    outputs = {
        "stages": status,
        "decision": decision,
        "decided": decided,
        "version": promotion["version"] if promoted else None,
        "production": None if production is None else str(root / production),
        "reasons": promotion["reasons"],
        "message": decision_message(promotion, production, decided),
        "report": str(report),
        "metrics": str(metrics_file),
        "train_metrics": str(root / config.train.metrics_dir),
        "candidate": str(root / config.train.output_dir),
        "registry": str(root / config.promote.registry),
    }
    print("outputs: " + json.dumps(outputs, indent=1))
    return outputs


def serve_deployments(repo_dir: str = ".") -> None:
    """Serve the deployments of ``prefect.yaml`` (:func:`deployments`) for the project in
    ``repo_dir``, without a work pool."""
    from prefect import serve

    # The runs that `serve` starts inherit this process's environment: this pins their project.
    os.environ[PROJECT_ENV] = str(Path(repo_dir).resolve())
    # One run at a time across all three: a schedule firing during a manual run waits instead
    # of racing it for the same workspace.
    serve(*deployments(repo_dir), limit=1)


# The deployments' definitions, also read by `prefect deploy --all`.
DEPLOYMENTS_FILE = Path(__file__).resolve().parents[1] / "prefect.yaml"


def deployments(repo_dir: str = ".") -> list[RunnerDeployment]:
    """The deployments that the project's ``prefect.yaml`` (else this code's) declares ('retrain/manual', 'retrain/scheduled',
    'retrain/on-new-data'), for `serve`: the same names, descriptions, parameters, triggers and
    concurrency limits, and the schedule from the project's ``schedule.cron`` and
    ``schedule.timezone`` (which the file's build steps read for `prefect deploy`).

    None takes the project folder as a parameter (:data:`PROJECT_ENV` pins it); Prefect checks
    each run's parameters against the flow's signature, so a run that names another folder, or
    a parameter the flow does not take, is refused before it starts.
    """
    import yaml
    from prefect.client.schemas.objects import ConcurrencyLimitConfig
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    when = _load_params(repo_dir).schedule
    own = Path(repo_dir) / "prefect.yaml"
    declared = yaml.safe_load((own if own.is_file() else DEPLOYMENTS_FILE).read_text())
    served = []
    for spec in declared["deployments"]:
        limit = spec.get("concurrency_limit")
        served.append(
            retrain.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                parameters=spec.get("parameters") or {},
                schedules=(
                    [Cron(when.cron, timezone=when.timezone)] if spec.get("schedules") else None
                ),
                triggers=[DeploymentEventTrigger(**t) for t in spec.get("triggers") or []],
                concurrency_limit=None if limit is None else ConcurrencyLimitConfig(**limit),
                enforce_parameter_schema=spec.get("enforce_parameter_schema", True),
            )
        )
    # to_deployment returns a coroutine only when it is called from async code.
    return cast("list[RunnerDeployment]", served)


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


def local_server_settings() -> AbstractContextManager[Any]:
    """Prefect settings for the temporary server that a run without a Prefect server starts,
    each only where neither the environment nor the active Prefect profile sets it.

    Telemetry off: its service writes a session row into the server's new SQLite database while
    the server sets itself up (a "database is locked" traceback when the two collide) and posts
    to Prefect (an error without a network); either reads as a failure when none happened.
    A longer start-up wait: on a busy two-core machine a first start, which creates the
    database, takes about 40 s, twice Prefect's default wait.
    """
    from prefect.settings import (
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    return temporary_settings(
        set_defaults={
            PREFECT_SERVER_ANALYTICS_ENABLED: False,
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120,
        }
    )


def _parse_set(assignment: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON where it is JSON (``2``, ``0.1``, ``true``,
    ``null``) and as a string otherwise (``token-sum``)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"error: --set takes KEY=VALUE, e.g. ppo.epochs=2; got {assignment!r}")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def main(argv: list[str] | None = None, server: LocalServer | None = None) -> None:
    """The command line; ``server`` is the run's own Prefect server when one was started
    already (:mod:`flows.local_server`); ``run`` starts one itself where it needs one."""
    import argparse

    from flows.run_params import RUN_PARAMS

    parser = argparse.ArgumentParser(
        prog="python -m flows.pipeline", description="Run or serve the Prefect flow 'retrain'."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser(
        "run",
        help="run the flow once now",
        description="Run the flow once now, on a temporary local Prefect server unless "
        "PREFECT_API_URL names one.",
    )
    run_parser.add_argument("--repo", default=".", help="the project folder (default: here)")
    run_parser.add_argument(
        "--from-production",
        action="store_true",
        help="start from the current production version, as the scheduled deployment does",
    )
    run_parser.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a training setting for this run only (params.yaml is put back afterwards), "
        f"repeatable; one of: {', '.join(sorted(RUN_PARAMS))}",
    )
    serve_parser = sub.add_parser(
        "serve",
        help="serve the deployments of prefect.yaml",
        description="Serve 'retrain/manual', 'retrain/scheduled' and 'retrain/on-new-data' "
        "(prefect.yaml) for one project folder, fixed here: a run cannot choose another. "
        "`prefect deploy --all` and a worker do the same through a work pool.",
    )
    serve_parser.add_argument("--repo", default=".", help="the project folder (default: here)")
    args = parser.parse_args(argv)
    os.environ[PROJECT_ENV] = str(Path(args.repo).resolve())
    if args.command == "serve":
        with local_server_settings():
            serve_deployments(args.repo)
        return
    from flows.local_server import LocalServer, LocalServerError, api_url_named
    from flows.run_params import RunParamsError
    from ppo_core.config import ConfigError

    if server is None and not api_url_named():
        server = LocalServer()
    try:  # before the server is waited for: a typo is one line, not a flow's traceback
        params = dict(_parse_set(a) for a in args.set)
        check_run_params(project_dir(), params)
    except (RunParamsError, ConfigError, SystemExit) as exc:
        if server is not None:  # started to overlap its start-up with the check: not needed now
            server.stop()
        if isinstance(exc, SystemExit):
            raise
        raise SystemExit(f"error: {exc}") from None
    with contextlib.ExitStack() as stack:
        if server is not None:
            from prefect.settings import temporary_settings

            try:
                server.wait_until_up()
            except LocalServerError as exc:
                raise SystemExit(f"error: {exc}") from None
            stack.enter_context(temporary_settings(updates=server.settings()))
        outputs = retrain(from_production=args.from_production, params=params or None)
    print(summary(outputs))


if __name__ == "__main__":
    main(server=_early_server)
    # The process ends now: the interpreter's last garbage collection would walk every object
    # that Prefect and the run built, about 0.4-1 s on two cores for nothing (the memory goes
    # back with the process). Finalizers, exit handlers and flushing still run.
    import gc

    gc.freeze()
