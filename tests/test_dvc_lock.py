"""The committed ``dvc.lock`` records the committed code, data and params: a fresh clone's
``make run`` reruns no stage because of them (refresh the lock with ``make run`` and commit it).

Only the training pipeline (``dvc.yaml``): ``serving/dvc.yaml`` runs on demand, so a clone has
no lock for it until its first export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"


def tracked_by_git() -> set[str]:
    """Every file git tracks, and every folder holding one."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = set(files)
    for name in files:
        found.update(str(parent) for parent in Path(name).parents if str(parent) != ".")
    return found


def test_the_lock_records_the_tracked_dependencies_as_they_are():
    done = subprocess.run(
        [str(BIN / "dvc"), "status", "--json", "dvc.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    tracked = tracked_by_git()
    stale = {}
    for stage, items in json.loads(done.stdout or "{}").items():
        for item in items:
            changed = item.get("changed deps", {}) if isinstance(item, dict) else {}
            # a stage's output used as a dependency (data/interim, models/base) is absent from a
            # fresh clone; what git holds must match the lock
            stale.update(
                {f"{stage}: {path}": what for path, what in changed.items() if path in tracked}
            )
    assert not stale, f"dvc.lock is stale (run `make run` and commit dvc.lock): {stale}"
