"""Putting a new version folder in place so that a kill at any point loses nothing and blocks
nothing; shared by the production registry (``vNNNN``, :mod:`ppo_core.registry.versions`) and
the reward registry (``rNNNN``, :mod:`ppo_core.registry.rewards`).

The protocol, under the registry's lock:

1. :func:`stage`: the folder is written into a hidden staging folder ``.<name>.staging`` beside
   the versions and hashed there (minutes for a large model, while nothing names it);
2. the caller records the entry as ``"promoting"`` with that hash and writes the registry;
3. :func:`put_in_place`: the staging folder is renamed to ``<name>`` (one rename);
4. the caller completes the entry (``"promoted"``, ``current``) and writes the registry again.

The next registry write runs :func:`recover_interrupted` first: a ``"promoting"`` entry whose
folder is in place with the recorded hash is completed (and made current, as the promotion
meant), any other is abandoned, and every staging copy left behind, recorded or not, is removed.
An abandoned promotion gives its number back, unless something lies under that name (a folder
with other content, a file): that is kept for inspection and the number stays taken, so that
it blocks no later promotion.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ppo_core.files import UnsafeCopyError, fsync_folder, fsync_tree, tree_sha256

__all__ = ["holds", "put_in_place", "recover_interrupted", "stage", "staging_folder"]

PROMOTING = "promoting"
"""An entry's decision between steps 2 and 4: recorded, maybe not in place yet."""


def staging_folder(versions_dir: str | Path, name: str) -> Path:
    """Where version ``name`` is written before it is in place."""
    return Path(versions_dir) / f".{name}.staging"


def _remove(path: Path) -> None:
    """Remove a staging copy: a folder with what it holds, anything else (a link) itself."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def holds(folder: Path, recorded: object) -> bool:
    """Whether the folder ``folder`` has the content hash ``recorded``; a link or special file
    inside it means no."""
    if not folder.is_dir() or folder.is_symlink() or not isinstance(recorded, str):
        return False
    try:
        return tree_sha256(folder) == recorded
    except UnsafeCopyError:  # a link or special file in it
        return False


def stage(versions_dir: str | Path, name: str, fill: Callable[[Path], object]) -> tuple[Path, str]:
    """Step 1: ``fill(folder)`` writes the version into its staging folder (a leftover there is
    removed first, never written into), synced to disk; returns the folder and its content
    SHA-256. An error removes the staging folder (a kill leaves it to :func:`recover_interrupted`)."""
    staging = staging_folder(versions_dir, name)
    _remove(staging)
    staging.mkdir(parents=True)
    try:
        fill(staging)
        fsync_tree(staging)
        return staging, tree_sha256(staging)
    except BaseException:
        _remove(staging)
        raise


def put_in_place(staging: Path, target: Path) -> None:
    """Step 3: one rename, made durable."""
    os.rename(staging, target)
    fsync_folder(target.parent)


def recover_interrupted(versions_dir: str | Path, registry: dict[str, Any], prefix: str) -> bool:
    """Finish or abandon the promotions a kill interrupted and remove every staging copy of a
    version named ``<prefix>NNNN`` (module docstring); True when ``registry`` changed. Runs
    under the lock, before anything else is decided: no promotion is under way then, so every
    staging copy is a leftover."""
    changed = False
    for entry in registry["entries"]:
        if entry.get("decision") != PROMOTING:
            continue
        name = entry.get("version")
        folder = Path(versions_dir) / name if isinstance(name, str) else None
        if folder is not None and holds(folder, entry.get("content_sha256")):
            entry["decision"] = "promoted"
            registry["current"] = name
        else:
            entry["decision"] = "abandoned"
            reasons = entry.get("reasons")
            reasons = reasons if isinstance(reasons, list) else []
            if folder is not None and os.path.lexists(folder):
                # not what was recorded: kept, and its number stays taken (never reused)
                why = (
                    f"interrupted before it was in place; {folder} does not hold the content "
                    "recorded for it and is kept for inspection (its number is not reused)"
                )
            else:
                why = "interrupted before it was in place"
                entry.pop("version", None)  # nothing holds the number: the next one takes it
                entry.pop("path", None)
            entry["reasons"] = [*reasons, why]
        changed = True
    pattern = re.compile(rf"\.{re.escape(prefix)}[0-9]{{4,}}\.staging")
    if Path(versions_dir).is_dir():
        for leftover in list(Path(versions_dir).iterdir()):
            if pattern.fullmatch(leftover.name):
                _remove(leftover)
    return changed
