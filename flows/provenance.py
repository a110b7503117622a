"""Which code made an output (layer 3): the git commit of the project and whether its tracked
files differed from it.

Recorded in the model registry's entries, beside the data hash and the config; not in
checkpoints or the candidate, which are DVC outputs (a commit inside them would change with
the very commit that records ``dvc.lock``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["PIPELINE_REWRITES", "code_version"]

PIPELINE_REWRITES = ("dvc.lock", "reports")
"""Tracked paths the pipeline itself rewrites while it runs (DVC's lock, the metrics files
git keeps): a change there does not make the code differ from its commit."""


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=folder, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def code_version(folder: str | Path = ".") -> dict[str, object]:
    """``{"commit": <hex or None>, "dirty": <bool or None>}`` for the git work tree that holds
    ``folder`` (the project, where stages run). ``dirty`` says whether a tracked file other than
    :data:`PIPELINE_REWRITES` differs from the commit; both are None outside a git work tree or
    without git."""
    folder = Path(folder)
    commit = _git(folder, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    excluded = [f":(exclude){path}" for path in PIPELINE_REWRITES]
    changes = _git(folder, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    return {"commit": commit.strip(), "dirty": None if changes is None else bool(changes.strip())}
