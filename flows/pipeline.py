"""The Prefect flow ``retrain``: the DVC stages in order, with retries, logs and artifacts.

Each task runs ``dvc repro --single-item <stage>`` in the repository, so the stage logic stays
in ``ppo <stage>`` and ``dvc.lock`` stays true: a stage whose inputs did not change is skipped, a
retried ``train`` resumes from its persisted checkpoints.

    python -m flows.pipeline run                 # one run now (temporary local Prefect server)
    python -m flows.pipeline serve               # deployments 'retrain/manual' and 'retrain/scheduled'
    prefect deployment run 'retrain/manual'      # with `serve` running and a Prefect server up
"""

from __future__ import annotations

import codecs
import io
import json
import linecache
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed

from ppo_core.files import atomic_write_text

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

    from ppo_core.config import Config

STAGES = ("prepare", "base", "validate", "train", "evaluate", "promote")
# Stages worth retrying: the long, resumable ones. A validation failure is not retried.
RETRIED = {"train": 2, "evaluate": 1}


class StageFailed(RuntimeError):
    """A DVC stage exited with an error; the message carries the end of its output."""


# A progress bar redrawn in place (tqdm, rich) is logged at most this often while it runs, so a
# long one shows that it moves and a short one (loading weights) adds no line at INFO.
PROGRESS_EVERY_S = 10.0
# Lines of a failed stage's output quoted in its error.
TAIL_LINES = 15
# Python's default warning format: `path:line: Category: message`, then the source line.
WARNING_LINE = re.compile(
    r"(?P<path>\S.*?\.py):(?P<line>\d+): (?P<category>\w+Warning): (?P<text>.*)"
)
# DVC's advice after each stage that changed dvc.lock; said once, at the end of the run, instead.
DVC_TRACK_HINT = "To track the changes with git, run:"
DVC_HINT_LINES = {
    "To enable auto staging, run:",
    "dvc config core.autostage true",
    "Use `dvc push` to send your updates to remote storage.",
}


def _environment() -> dict[str, str]:
    """PATH with this interpreter's bin folder first, so `dvc` and `ppo` are the project's;
    unbuffered Python output, so that a stage's lines reach the log as they are printed."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # Rich wraps its output at 80 columns when it does not write to a terminal, which would cut
    # one message into two log records; the log has no width of its own.
    env["COLUMNS"] = "200"
    return env


def output_segments(stream: IO[bytes]) -> Iterator[tuple[str, bool]]:
    """The text of ``stream`` as it arrives, cut at line ends and carriage returns:
    ``(text, True)`` for a finished line, ``(text, False)`` for what a progress bar then draws
    over (the text before a lone ``\\r``)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        # What the pipe holds now, not a full buffer: a line is logged when it is printed.
        chunk = os.read(stream.fileno(), 65536)
        pending += decoder.decode(chunk, final=not chunk)
        while True:
            cut = min((i for i in (pending.find("\r"), pending.find("\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            if pending[cut] == "\n":
                yield pending[:cut], True
                pending = pending[cut + 1 :]
            elif cut + 1 < len(pending):
                crlf = pending[cut + 1] == "\n"
                yield pending[:cut], crlf
                pending = pending[cut + 2 if crlf else cut + 1 :]
            elif chunk:
                break  # a `\r` at the end of the data read so far: the next byte says which
            else:
                yield pending[:cut], True
                pending = ""
        if not chunk:
            if pending:
                yield pending, True
            return


class StageRelay:
    """Turns the output of one stage into log records, as a reader of the log wants it.

    A line redrawn in place (a progress bar) is logged every ``progress_every`` seconds while it
    lasts and its final state at INFO only when it lasted that long (at DEBUG otherwise). DVC's
    advice to `git add` is kept back (:attr:`to_track` names the files) to be said once per run.
    A Python warning is logged at WARNING without the source line that Python prints under it,
    which reads like a traceback. Blank lines are dropped; the rest is logged at INFO and the
    last :data:`TAIL_LINES` are kept for the error of a failed stage.
    """

    def __init__(
        self,
        stage: str,
        log: Callable[[int, str], None],
        repo_dir: str | Path = ".",
        progress_every: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stage = stage
        self.log = log
        self.repo_dir = Path(repo_dir).resolve()
        self.progress_every = progress_every
        self.clock = clock
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.to_track: list[str] = []
        self.skipped = False
        self._bar_since: float | None = None  # when the current line was first drawn over
        self._bar_shown = False
        self._in_track_hint = False
        self._warning_source: str | None = None

    def feed(self, text: str, finished: bool) -> None:
        text = text.rstrip()
        if not finished:
            now = self.clock()
            if self._bar_since is None:
                self._bar_since = now
            elif text and now - self._bar_since >= self.progress_every:
                self.log(logging.INFO, text)
                self._bar_since, self._bar_shown = now, True
            return
        redrawn, shown = self._bar_since is not None, self._bar_shown
        self._bar_since, self._bar_shown = None, False
        if not text:
            return
        if redrawn:
            self.log(logging.INFO if shown else logging.DEBUG, text)
        elif not self._dvc_hint(text) and not self._warning(text):
            if f"Stage '{self.stage}' didn't change" in text:
                self.skipped = True
            self.log(logging.INFO, text)
            self.tail.append(text)

    def _dvc_hint(self, text: str) -> bool:
        line = text.strip()
        if line == DVC_TRACK_HINT:
            self._in_track_hint = True
            return True
        if self._in_track_hint and line.startswith("git add "):
            self._in_track_hint = False
            self.to_track += [f for f in shlex.split(line)[2:] if f not in self.to_track]
            return True
        return line in DVC_HINT_LINES

    def _warning(self, text: str) -> bool:
        if text.startswith("  ") and text.strip() == self._warning_source:
            self._warning_source = None
            return True
        found = WARNING_LINE.fullmatch(text)
        if found is None:
            return False
        path, line = Path(found["path"]), int(found["line"])
        # Python prints the source line when it can read it; the same file is read here.
        self._warning_source = linecache.getline(str(path), line).strip() or None
        if path.is_absolute() and path.is_relative_to(self.repo_dir):
            path = path.relative_to(self.repo_dir)
        message = f"{found['category']}: {found['text']} ({path}:{line})"
        self.log(logging.WARNING, message)
        self.tail.append(message)
        return True


def relay_command(command: list[str], cwd: str, env: dict[str, str], relay: StageRelay) -> int:
    """Run ``command`` with its output (stderr merged into stdout, in order) fed to ``relay``
    as it arrives; returns the exit code."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert process.stdout is not None
    try:
        with process.stdout:
            for text, finished in output_segments(process.stdout):
                relay.feed(text, finished)
    except BaseException:
        # Cancelled or interrupted: DVC gets the chance to stop its stage and release its lock.
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise
    return process.wait()


@task(name="dvc-repro", task_run_name="{stage}")
def run_stage(stage: str, repo_dir: str) -> dict[str, Any]:
    """Run ``dvc repro --single-item <stage>`` in ``repo_dir``; log its output as it comes;
    raise on failure. Returns ``{"status": "ran" | "skipped", "to_track": [files]}``, the
    files DVC asks to `git add`.

    The flow runs the stages in DAG order, so the upstream ones are already up to date;
    ``--single-item`` spares each call re-checking (and re-hashing) all of them.
    """
    logger = get_run_logger()
    # `stage | line`, not `[stage] line`: `prefect deployment run --watch` prints log messages
    # as Rich markup, in which `[stage]` is a tag and vanishes.
    relay = StageRelay(
        stage, lambda level, text: logger.log(level, "%s | %s", stage, text), repo_dir
    )
    returncode = relay_command(
        [str(Path(sys.executable).parent / "dvc"), "repro", "--single-item", stage],
        cwd=repo_dir,
        env=_environment(),
        relay=relay,
    )
    if returncode != 0:
        tail = "\n".join(relay.tail)
        raise StageFailed(f"stage {stage} failed with exit code {returncode}:\n{tail}")
    return {"status": "skipped" if relay.skipped else "ran", "to_track": relay.to_track}


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
        outputs = _retrain(repo_dir, from_production, params)
    # A returned state is the run's final state: its message, the decision, shows in the UI, in
    # `prefect flow-run inspect` and in the run's last log line ("Finished in state
    # Completed('promoted as ...')"); callers of the flow get its data, the outputs.
    return cast("dict[str, Any]", Completed(message=outputs["message"], data=outputs))


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
    to_track: list[str] = []
    for stage in STAGES:
        runner = run_stage.with_options(retries=RETRIED.get(stage, 0), retry_delay_seconds=5)
        result = runner(stage, repo_dir)
        status[stage] = result["status"]
        to_track += [f for f in result["to_track"] if f not in to_track]
    outputs = publish_results(repo_dir, status)
    if to_track:
        files = shlex.join(to_track)
        print(
            f"{files} changed: `git add {files}` records this run in git; `dvc push` stores "
            "its outputs in the DVC remote"
        )
    # Last, so that it ends the run's log.
    print(f"decision: {outputs['message']}")
    announce_decision(outputs)
    return outputs


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


def decision_message(
    promotion: dict[str, Any], production: str | None, decided: bool = True
) -> str:
    """One line: the version this run promoted, or why it rejected the candidate, or that it
    had nothing to decide (``decided`` false: the promote stage was skipped), and then which
    production version (``production``, its folder) stays in place."""
    stays = (
        f"production stays {Path(production).name}: {production}"
        if production
        else "no production model yet"
    )
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
    with local_server_settings():
        if args.command == "run":
            outputs = retrain(repo_dir=args.repo, from_production=args.from_production)
            print(summary(outputs))
        else:
            serve_deployments(args.repo)


if __name__ == "__main__":
    main()
