"""What a run of the flow leaves behind for later: a DVC experiment of the run, and a backup of
the production versions and the registry in the DVC remote.

Both run DVC commands in the project after the stages (a stage cannot call DVC: ``dvc repro``
holds the repository's lock while it runs one): through the flow's DVC process when the caller
passes one (``run``, see :class:`flows.orchestration.dvc_session.DvcSession`), else as ``dvc`` commands.
Neither fails a run that trained and decided: a project outside git, or a remote that cannot be
reached, is reported in the run's log and leaves the run's outcome as it was.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ppo_core.config import Config

DVC_TIMEOUT = 600.0
# Slower than the default to time out: pushing a large model to a remote takes a while.
PUSH_TIMEOUT = 6 * 3600.0


@dataclass(frozen=True)
class Outcome:
    done: bool
    message: str


# Runs ``dvc ARGS`` in the project within ``timeout`` seconds; returns the exit code and the
# output (stdout and stderr).
DvcRunner = Callable[[Sequence[str], float], tuple[int, str]]


def dvc_command(repo_dir: str | Path) -> DvcRunner:
    """A :data:`DvcRunner` that starts the ``dvc`` command of this interpreter for each call."""

    def run(args: Sequence[str], timeout: float) -> tuple[int, str]:
        try:
            done = subprocess.run(
                [str(Path(sys.executable).parent / "dvc"), *args],
                cwd=repo_dir,
                capture_output=True,
                text=True,
                check=False,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return 124, f"`dvc {' '.join(args)}` ran longer than {timeout:g} s and was stopped"
        return done.returncode, done.stdout + done.stderr

    return run


def _last_line(code: int, output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {code}"


def experiment_name(flow_run_name: str) -> str:
    """``retrain-<flow run name>``, cut to what a git reference may hold."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", flow_run_name).strip("-") or "run"
    return f"retrain-{cleaned}"[:100]


def save_experiment(
    repo_dir: str | Path,
    name: str,
    untracked: Sequence[str] = (),
    run: DvcRunner | None = None,
    stages: Sequence[str] = (),
) -> Outcome:
    """``dvc exp save --name NAME --force [STAGES]``: the workspace as it is now
    (``params.yaml`` with the run's values, ``dvc.lock`` with its data and model hashes, the
    metrics files) as a DVC experiment, which ``dvc exp show`` and ``ppo compare`` list. It
    changes no file of the workspace and no git branch; ``--force`` replaces an experiment of
    the same name (the same flow run, retried). ``untracked`` files are included too (the
    backup's pointers before they are committed).

    DVC caches the outputs of ``stages`` first (every stage's when empty); after ``dvc repro``
    they are all cached already, and naming one spares hashing the others again."""
    included = [arg for path in untracked for arg in ("--include-untracked", path)]
    run = run or dvc_command(repo_dir)
    command = ["exp", "save", "--name", name, "--force", *included, *stages]
    code, output = run(command, DVC_TIMEOUT)
    if code != 0:
        return Outcome(False, f"not recorded as a DVC experiment: {_last_line(code, output)}")
    return Outcome(True, f"recorded as the DVC experiment {name} (`dvc exp show`)")


def backup_targets(config: Config) -> list[str]:
    """The paths the backup tracks: the production folder, the registry and the reward
    versions (with their registry); those that exist are tracked."""
    return [
        config.promote.production_dir,
        config.promote.registry,
        config.reward_model.versions_dir,
    ]


def pointer_files(config: Config) -> list[str]:
    """The ``.dvc`` files that name the backed-up content (commit them with git)."""
    return [f"{target}.dvc" for target in backup_targets(config)]


def back_up_production(
    repo_dir: str | Path, config: Config, run: DvcRunner | None = None
) -> Outcome:
    """Track the production folder and the registry with DVC (``dvc add``: their content goes
    into the cache and ``<path>.dvc`` names it) and push both to the default remote.

    ``dvc pull <path>.dvc`` (:func:`restore_command`) brings them back byte for byte.
    """
    targets = backup_targets(config)
    if not Path(repo_dir, config.promote.registry).is_file():
        return Outcome(False, "nothing to back up yet (no registry)")
    present = [t for t in targets if Path(repo_dir, t).exists()]
    run = run or dvc_command(repo_dir)
    code, output = run(["add", *present], DVC_TIMEOUT)
    if code != 0:
        return Outcome(False, f"production and registry not backed up: {_last_line(code, output)}")
    pointers = [f"{t}.dvc" for t in present]
    code, output = run(["push", *pointers], PUSH_TIMEOUT)
    if code != 0:
        return Outcome(
            False,
            f"production and registry are in the DVC cache but not in the remote: "
            f"{_last_line(code, output)}; `dvc push {' '.join(pointers)}` sends them",
        )
    return Outcome(
        True,
        f"production and registry backed up in the DVC remote ({' '.join(pointers)}; restore "
        f"with `{restore_command(config, repo_dir)}`)",
    )


def restore_command(config: Config, repo_dir: str | Path = ".") -> str:
    """``dvc pull`` of the pointer files of ``repo_dir`` that exist."""
    present = [p for p in pointer_files(config) if Path(repo_dir, p).is_file()]
    return "dvc pull " + " ".join(present)
