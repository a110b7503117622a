"""The Prefect flow ``retrain``: the DVC stages in order, with retries, timeouts, logs and
artifacts.

Each task runs ``dvc repro --single-item <stage>`` in the project (through one DVC process a
run, :mod:`flows.orchestration.dvc_session`), so the stage logic stays in ``ppo <stage>`` and ``dvc.lock``
stays true: a stage whose inputs did not change is skipped, a retried ``train`` resumes from its
persisted checkpoints.

    python -m flows.pipeline run                 # one run now (its own local Prefect server)
    python -m flows.pipeline serve               # the deployments of prefect.yaml, no work pool
    prefect --no-prompt deploy --all             # the same for a work pool (see prefect.yaml)
    prefect deployment run 'retrain/manual'      # with a Prefect server up

The project a run works on is fixed where the flow is served (:data:`PROJECT_ENV`), never a
run parameter; a run's ``params`` are held to an allow-list (:mod:`flows.orchestration.run_params`).
"""

from __future__ import annotations

import sys

from flows.orchestration.project import PROJECT_ENV

if __name__ == "__main__":
    # `python -m flows.pipeline run`: start the run's own Prefect server (when none is named)
    # and its DVC process before the imports below, so that they import at the same time as
    # this process does.
    from flows.orchestration.dvc_session import run_folder, start_ahead
    from flows.orchestration.local_server import start_if_needed
    from flows.orchestration.relay import stage_environment

    _early_server = start_if_needed(sys.argv[1:])
    _folder = run_folder(sys.argv[1:])
    if _folder is not None:
        start_ahead(_folder, stage_environment() | {PROJECT_ENV: _folder})

import argparse
import contextlib
import json
import os
import shlex
import threading
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect import flow, get_client, get_run_logger, task
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.runtime import deployment, flow_run
from prefect.settings import temporary_settings
from prefect.states import Completed

from flows.ingest import Taken, take_inboxes
from flows.orchestration.deployments import serve_deployments
from flows.orchestration.dvc_session import DvcSession
from flows.orchestration.dvc_session import take as take_session
from flows.orchestration.local_server import (
    LocalServer,
    LocalServerError,
    api_url_named,
    local_server_settings,
)
from flows.orchestration.outcome import (
    announce_decision,
    nothing_new,
    publish_results,
    reject_ingested,
    summary,
)
from flows.orchestration.project import (
    RETRAIN_LOCK,
    RETRAIN_LOCK_HOLDER,
    load_params,
    production_version,
    project_dir,
)
from flows.orchestration.records import (
    back_up_production,
    experiment_name,
    pointer_files,
    save_experiment,
)
from flows.orchestration.relay import CommandTimedOut, StageRelay, stage_environment
from flows.orchestration.restarts import check_restart
from flows.orchestration.run_params import (
    RUN_PARAMS,
    RunParamsError,
    check_run_params,
    params_for_this_run,
    put_back_left_params,
)
from flows.raw_data import feedback_changes, raw_changes
from flows.stages import STAGES as STAGE_CATALOG
from ppo_core.config import ConfigError
from ppo_core.files import exclusive_run

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State
    from prefect.tasks import Task

    from flows.orchestration.records import DvcRunner

# The flow's stages in order, read from their registrations in flows/stages.py.
STAGES = tuple(name for name in STAGE_CATALOG if STAGE_CATALOG.trait(name, "flow"))
# Stages that run the models (on the accelerator, when there is one): they hold a slot of
# flow.gpu_limit while they run.
ACCELERATED = tuple(name for name in STAGES if STAGE_CATALOG.trait(name, "accelerated"))
# Stages worth retrying: the long, resumable ones. A validation failure is not retried.
RETRIED = {name: STAGE_CATALOG.trait(name, "retries") for name in STAGES}


class StageFailed(RuntimeError):
    """A DVC stage exited with an error; the message carries the end of its output."""


class StageTimedOut(StageFailed):
    """A DVC stage ran past its ``flow.<stage>_timeout`` and was stopped; never retried."""


# The DVC process of each project's running flow (:mod:`flows.orchestration.dvc_session`), shared by its
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
    :func:`flows.orchestration.dvc_session.start_ahead`), so that it imports DVC while the run takes its new
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
    files ``ppo ingest`` left in ``ingest.inbox_dir`` into ``data.raw_dir``, and those
    ``ppo ingest --feedback`` left in ``ingest.feedback_inbox_dir`` into ``data.feedback_dir``
    (:mod:`flows.ingest`).

    Args:
        from_production: start from the current production version (scheduled retraining);
            without one yet, from the configured base.
        params: training settings for this run only, e.g. ``{"ppo.epochs": 2}``: only the keys
            of ``flows.orchestration.run_params.RUN_PARAMS``, checked before anything is written, and held in
            ``params.yaml`` only while the run lasts.
        new_data_only: end at once, running no stage, when the raw prompts and the feedback
            are those of the prepared version (the deployments ``retrain/on-new-data`` and
            ``retrain/on-new-feedback``: a run triggered for files that an earlier run already
            took has nothing to do).
        backup: after a decision, back the production versions and the registry up in the DVC
            remote (:func:`flows.orchestration.records.back_up_production`); the deployments of
            ``prefect.yaml`` do.
        restart_limit: set by each deployment's trigger on its crashed runs (``prefect.yaml``):
            this run restarts one that crashed, and fails at once, running nothing, when the
            deployment's last ``restart_limit`` runs all crashed (:mod:`flows.orchestration.restarts`).

    Every run that reaches a decision is recorded as a DVC experiment
    (:func:`flows.orchestration.records.save_experiment`).
    """
    if restart_limit:
        check_restart(restart_limit, deployment.id, deployment.name or "")
    repo_dir = str(project_dir())
    updates = check_run_params(repo_dir, params)
    with (
        exclusive_run(Path(repo_dir) / RETRAIN_LOCK, RETRAIN_LOCK_HOLDER, on_wait=_waiting),
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
            version = production_version(repo_dir)
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


def _take_new_data(repo_dir: str) -> tuple[Taken, list[str]]:
    """Move the ingested files into the raw and the feedback folder; returns their names and
    how those folders now differ from the prepared version (``flows.raw_data.raw_changes``,
    ``flows.raw_data.feedback_changes``)."""
    config = load_params(repo_dir)
    with contextlib.chdir(repo_dir):
        taken = take_inboxes(config)
        changes = raw_changes(config) + feedback_changes(config)
    for names, folder in (
        (taken.prompts, config.data.raw_dir),
        (taken.feedback, config.data.feedback_dir),
    ):
        if names:
            print(f"took {len(names)} ingested file(s) into {folder}: {', '.join(names)}")
    return taken, changes


def _retrain(repo_dir: str, updates: dict[str, Any], taken: Taken, backup: bool) -> dict[str, Any]:
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


DATA_STAGES = ("prepare", "validate")
"""The stages whose outcome the data decides: their failure sets the taken files aside."""


def _run_stages(repo_dir: str, taken: Taken) -> tuple[dict[str, str], list[str]]:
    """Each stage as a task, in order; returns each stage's status and the files DVC asks to
    `git add`."""
    timeouts = load_params(repo_dir).flow  # and flow.gpu_limit
    status = {}
    to_track: list[str] = []
    for stage in STAGES:
        runner = run_stage.with_options(retries=RETRIED.get(stage, 0), retry_delay_seconds=5)
        slot = accelerator_slot(timeouts.gpu_limit) if stage in ACCELERATED else nullcontext()
        try:
            with slot:
                result = runner(stage, repo_dir, getattr(timeouts, f"{stage}_timeout"))
        except StageFailed as failed:
            # prepare and validate read the data alone: failing with files this run took, they
            # fail on them, and every later run would too while they stay
            if stage in DATA_STAGES and taken and not isinstance(failed, StageTimedOut):
                raise StageFailed(reject_ingested(repo_dir, taken, str(failed), stage)) from None
            raise
        status[stage] = result["status"]
        to_track += [f for f in result["to_track"] if f not in to_track]
    return status, to_track


def keep_records(repo_dir: str, backup: bool) -> list[str]:
    """Back production and the registry up (with ``backup``), then record the run as a DVC
    experiment named after the flow run, the backup's pointers included; log each outcome.
    Returns the pointer files to commit with git."""
    config = load_params(repo_dir)
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
    """A :data:`flows.orchestration.records.DvcRunner` that sends each command to this run's DVC process (a
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
    already (:mod:`flows.orchestration.local_server`); ``run`` starts one itself where it needs one."""
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
        description="Serve 'retrain/manual', 'retrain/scheduled', 'retrain/on-new-data' and "
        "'retrain/on-new-feedback' (prefect.yaml) for one project folder, fixed here: a run "
        "cannot choose another. `prefect deploy --all` and a worker do the same through a work "
        "pool.",
    )
    serve_parser.add_argument("--repo", default=".", help="the project folder (default: here)")
    args = parser.parse_args(argv)
    os.environ[PROJECT_ENV] = str(Path(args.repo).resolve())
    if args.command == "serve":
        with local_server_settings():
            serve_deployments(retrain, args.repo)
        return
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
