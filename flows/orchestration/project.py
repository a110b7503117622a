"""The project a run of the flow works on: its folder, its ``params.yaml`` (read once per text)
and its production version.

Imported before Prefect by ``python -m flows.pipeline run`` (the early start), so Prefect and
the config are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from flows.orchestration.run_params import RunParamsError

if TYPE_CHECKING:
    from ppo_core.config import Config

# The project folder of every run of the flow in this process and the runs it starts: set by
# `serve` (or the deployment's environment) from the folder it was given; the working folder
# when unset. A run cannot choose it, so it cannot point the flow at another `dvc.yaml`.
PROJECT_ENV = "PPO_PROJECT_DIR"

# The project's retraining lock, in its folder: a run of the flow holds it from start to end
# (others wait for it), and `ppo rollback` takes it too, so that a rollback never lands between
# a run's evaluation and its promotion (refused at once, naming the run that holds it).
RETRAIN_LOCK = ".retrain.lock"
RETRAIN_LOCK_HOLDER = "retraining run in this repository"


def project_dir() -> Path:
    """The project folder runs of the flow work in: ``$PPO_PROJECT_DIR``, else the working
    folder; resolved.

    Raises:
        RunParamsError: this run's own job variables set ``PPO_PROJECT_DIR``: a run request to a
            work pool may override the deployment's environment, but not move its project."""
    # Prefect and the config are imported here, not at the top: `python -m flows.pipeline run`
    # imports this module before them (the early start).
    from prefect.runtime import flow_run

    requested = (flow_run.get_job_variables() or {}).get("env") or {}
    if isinstance(requested, dict) and PROJECT_ENV in requested:
        raise RunParamsError(
            f"job_variables: {PROJECT_ENV} cannot be set by a flow run; the project folder is "
            "fixed where the deployment is defined (prefect.yaml) or served"
        )
    return Path(os.environ.get(PROJECT_ENV) or ".").resolve()


# The config of each project's params.yaml with the text it was built from: a run reads it at
# every step, and building it (OmegaConf's merge and the checks) takes 0.1-0.6 s each time.
_PARAMS: dict[Path, tuple[str, Config]] = {}


def load_params(repo_dir: str) -> Config:
    """The config of ``repo_dir``'s ``params.yaml``, built again only when the file's text
    changed (a run's own values come and go, :func:`flows.orchestration.run_params.params_for_this_run`).
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


def production_version(repo_dir: str) -> str | None:
    """The production version's folder relative to ``repo_dir``, or ``None`` before the first
    promotion."""
    from ppo_core.registry.versions import current_production

    config = load_params(repo_dir)
    registry = Path(repo_dir) / config.promote.registry
    production = current_production(registry, Path(repo_dir) / config.promote.production_dir)
    return None if production is None else str(production.relative_to(Path(repo_dir).resolve()))


def stays(production: str | None) -> str:
    """Which production version stays in place (``production``, its folder)."""
    if not production:
        return "no production model yet"
    return f"production stays {Path(production).name}: {production}"


@contextlib.contextmanager
def stage_retrain_lock(repo: str | Path = "."):
    """The retraining lock for a stage run on its own (``ppo reward``, ``dvc repro reward``):
    taken, or refused at once naming the run that holds it; when the holder is this process or
    one it descends from (a run of the flow, whose ``dvc repro`` runs the stage), the stage runs
    under that run's lock."""
    from ppo_core.files import exclusive_run

    lock = Path(repo) / RETRAIN_LOCK
    if _held_by_an_ancestor(lock):
        yield
        return
    with exclusive_run(lock, RETRAIN_LOCK_HOLDER):
        yield


def _held_by_an_ancestor(lock: Path) -> bool:
    """Whether ``lock`` names as its holder (``pid N since ...``, what the holder writes once it
    holds it) this process or one of its parents, and is held."""
    import fcntl
    import re

    import psutil

    try:
        note = lock.read_text(errors="replace")[:256]
    except OSError:
        return False
    found = re.match(r"pid (\d+) since ", note)
    if found is None:
        return False
    holder = int(found.group(1))
    me = psutil.Process()
    if holder not in {me.pid, *(parent.pid for parent in me.parents())}:
        return False
    # a stale note of an ancestor that no longer holds it: the lock is free, so take it instead
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(lock, flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # held exclusively, by the ancestor the note names
    finally:
        os.close(fd)
    return False
