"""What a run of the flow leaves behind for later: a DVC experiment of the run, and a backup of
the production versions and the registry in the DVC remote.

Both go through the ``dvc`` command in the project, after the stages (a stage cannot call DVC:
``dvc repro`` holds the repository's lock while it runs one). Neither fails a run that trained
and decided: a project outside git, or a remote that cannot be reached, is reported in the
run's log and leaves the run's outcome as it was.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ppo_core.config import Config

# Slower than the default to time out: pushing a large model to a remote takes a while.
PUSH_TIMEOUT = 6 * 3600


@dataclass(frozen=True)
class Outcome:
    done: bool
    message: str


def _dvc(repo_dir: str | Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), *args],
        cwd=repo_dir,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {done.returncode}"


def experiment_name(flow_run_name: str) -> str:
    """``retrain-<flow run name>``, cut to what a git reference may hold."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", flow_run_name).strip("-") or "run"
    return f"retrain-{cleaned}"[:100]


def save_experiment(repo_dir: str | Path, name: str, untracked: Sequence[str] = ()) -> Outcome:
    """``dvc exp save --name NAME --force``: the workspace as it is now (``params.yaml`` with the
    run's values, ``dvc.lock`` with its data and model hashes, the metrics files) as a DVC
    experiment, which ``dvc exp show`` and ``ppo compare`` list. It changes no file of the
    workspace and no git branch; ``--force`` replaces an experiment of the same name (the same
    flow run, retried). ``untracked`` files are included too (the backup's pointers before
    they are committed)."""
    included = [arg for path in untracked for arg in ("--include-untracked", path)]
    done = _dvc(repo_dir, "exp", "save", "--name", name, "--force", *included)
    if done.returncode != 0:
        return Outcome(False, f"not recorded as a DVC experiment: {_last_line(done)}")
    return Outcome(True, f"recorded as the DVC experiment {name} (`dvc exp show`)")


def backup_targets(config: Config) -> list[str]:
    """The paths the backup tracks: the production folder and the registry."""
    return [config.promote.production_dir, config.promote.registry]


def pointer_files(config: Config) -> list[str]:
    """The ``.dvc`` files that name the backed-up content (commit them with git)."""
    return [f"{target}.dvc" for target in backup_targets(config)]


def back_up_production(repo_dir: str | Path, config: Config) -> Outcome:
    """Track the production folder and the registry with DVC (``dvc add``: their content goes
    into the cache and ``<path>.dvc`` names it) and push both to the default remote.

    ``dvc pull <path>.dvc`` (:func:`restore_command`) brings them back byte for byte.
    """
    targets = backup_targets(config)
    if not Path(repo_dir, config.promote.registry).is_file():
        return Outcome(False, "nothing to back up yet (no registry)")
    present = [t for t in targets if Path(repo_dir, t).exists()]
    added = _dvc(repo_dir, "add", *present)
    if added.returncode != 0:
        return Outcome(False, f"production and registry not backed up: {_last_line(added)}")
    pointers = [f"{t}.dvc" for t in present]
    pushed = _dvc(repo_dir, "push", *pointers, timeout=PUSH_TIMEOUT)
    if pushed.returncode != 0:
        return Outcome(
            False,
            f"production and registry are in the DVC cache but not in the remote: "
            f"{_last_line(pushed)}; `dvc push {' '.join(pointers)}` sends them",
        )
    return Outcome(
        True,
        f"production and registry backed up in the DVC remote ({' '.join(pointers)}; restore "
        f"with `{restore_command(config)}`)",
    )


def restore_command(config: Config) -> str:
    return "dvc pull " + " ".join(pointer_files(config))
