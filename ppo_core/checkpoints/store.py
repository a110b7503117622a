"""Atomic, resumable checkpoints (layer 2).

A checkpoint is a folder ``step-000040/`` holding the model, the optimizer and scheduler states,
``trainer_state.json`` (iteration, KL coefficient, lineage) and ``checksums.json`` (SHA-256 of
every file). It is written into a hidden temporary folder and renamed into place, so a crash
never leaves a half checkpoint. Reading one runs no code from it: tensors and optimizer states
through ``torch.load(weights_only=True)``, the DCP metadata of a sharded one through an
unpickler that builds DCP's own metadata classes and nothing else
(:func:`ppo_core.checkpoints.sharded.read_dcp_metadata`). ``checksums.json`` detects
damage (a truncated or changed file), not tampering: whoever can write a checkpoint can rewrite
its checksums. It comes in two formats:

- whole (:func:`save_checkpoint`, written by one process): ``model/`` is a ``save_pretrained``
  folder (safetensors, tokenizer, value head) and ``optimizer.pt`` the optimizer's
  ``state_dict()``;
- sharded (:mod:`ppo_core.checkpoints.sharded`, written by every rank of a sharded run
  at once): ``shards/`` is a ``torch.distributed.checkpoint`` (DCP) folder, ``model/`` holds
  the config and the tokenizer only.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ppo_core.files import atomic_folder, discard, file_sha256, first_line, is_partial, printable

__all__ = [
    "METRIC_NAME",
    "CheckpointError",
    "checked_history",
    "list_checkpoints",
    "load_checkpoint_state",
    "load_latest_good",
    "remove_partial",
    "save_checkpoint",
    "verify_checksums",
]

STEP_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"
MODEL_DIR = "model"
SHARDED = "sharded"
"""``trainer_state.json``'s ``checkpoint_format`` for a sharded checkpoint (absent: whole)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""


METRIC_NAME = re.compile(r"[a-z][a-z0-9_]*/[a-z][a-z0-9_]*")
"""A metric name as the trainer writes it, ``group/name`` in lowercase words. Names become file
paths in the metrics logger, so a name from a checkpoint's history must be one of these."""


def checked_history(history: object, where: str) -> list[dict[str, float]]:
    """The metric history stored in a checkpoint, each row ``{"iteration": n, "group/name": x}``,
    or a :class:`CheckpointError` naming ``where`` and the first thing that is not."""
    if not isinstance(history, list):
        raise CheckpointError(f"{where}: history is not a list")
    rows = []
    for number, row in enumerate(history):
        if not isinstance(row, dict):
            raise CheckpointError(f"{where}: history row {number} is not a mapping")
        for name, value in row.items():
            if not isinstance(name, str) or not (
                name == "iteration" or METRIC_NAME.fullmatch(name)
            ):
                shown = repr(name)[:40]
                raise CheckpointError(
                    f"{where}: history row {number} has the metric name {shown}, not group/name"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CheckpointError(f"{where}: history row {number}: {name} is not a number")
        rows.append({name: float(value) for name, value in row.items()})
    return rows


def remove_partial(checkpoint_dir: str | Path) -> list[str]:
    """Remove what killed writers left in ``checkpoint_dir``: hidden temporary, replaced and
    half-deleted checkpoint folders. Call it only while holding the run lock. Returns their names.
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        if is_partial(path.name, STEP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return sorted(removed)


def _write_checksums(folder: Path) -> None:
    sums = {
        str(p.relative_to(folder)): file_sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKSUM_FILE
    }
    (folder / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1))


def verify_checksums(folder: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing or changed file."""
    folder = Path(folder)
    listing = folder / CHECKSUM_FILE
    if not listing.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {CHECKSUM_FILE}; it is incomplete")
    for name, expected in json.loads(listing.read_text()).items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(
                f"checkpoint {folder}: {CHECKSUM_FILE} names a file outside it "
                f"({printable(name)!r}); it was not written by this project"
            )
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {printable(name)}")
        if file_sha256(path) != expected:
            raise CheckpointError(f"checkpoint {folder}: {name} is damaged (checksum mismatch)")


def save_checkpoint(
    checkpoint_dir: str | Path,
    iteration: int,
    save_model: Callable[[Path], None],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-{iteration:06d}`` atomically and keep the newest ``keep``.

    ``optimizer_state`` is in ``optimizer.state_dict()``'s format, as one process holding every
    parameter would have it."""

    def write(tmp: Path) -> None:
        save_model(tmp / MODEL_DIR)
        save_tensors(optimizer_state, tmp / "optimizer.pt")
        write_run_state(tmp, iteration, scheduler, state)

    return commit_checkpoint(Path(checkpoint_dir), iteration, write, keep)


def write_run_state(tmp: Path, iteration: int, scheduler: Any, state: dict[str, Any]) -> None:
    if scheduler is not None:
        save_tensors(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=1))
    _write_checksums(tmp)


def commit_checkpoint(
    checkpoint_dir: Path, iteration: int, write: Callable[[Path], None], keep: int
) -> Path:
    path = atomic_folder(checkpoint_dir / f"{STEP_PREFIX}{iteration:06d}", write)
    for old in list_checkpoints(checkpoint_dir)[:-keep]:
        discard(old)
    return path


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are hidden and skipped)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted(found, key=lambda p: p.name)


def load_latest_good(
    checkpoint_dir: str | Path,
) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint that verifies, its state, and one line per damaged newer one.

    A damaged checkpoint (a truncated or changed file) is skipped, never deleted, so that it can
    be inspected; the previous good one is used instead.
    """
    problems: list[str] = []
    for folder in reversed(list_checkpoints(checkpoint_dir)):
        try:
            return folder, load_checkpoint_state(folder), problems
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            problems.append(f"{folder.name}: {exc}")
    return None, None, problems


def load_checkpoint_state(folder: str | Path) -> dict[str, Any]:
    """Verify and read a checkpoint: ``state``, ``optimizer``, ``scheduler``, ``model_dir`` (a
    model folder to load, None for a sharded checkpoint) and ``sharded`` (the checkpoint's folder
    for :func:`load_sharded_checkpoint`, None for a whole one)."""
    folder = Path(folder)
    verify_checksums(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    sharded = state.get("checkpoint_format") == SHARDED
    optimizer = None if sharded else load_tensors(folder / "optimizer.pt")
    scheduler_file = folder / "scheduler.pt"
    scheduler = load_tensors(scheduler_file) if scheduler_file.is_file() else None
    return {
        "state": state,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "model_dir": None if sharded else folder / MODEL_DIR,
        "sharded": folder if sharded else None,
    }


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, then one plain file write: a full disk or a read-only
    folder raises ``OSError`` with its errno (torch's own writer reports those as a bare
    ``RuntimeError: iostream error``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with path.open("wb") as handle:
        handle.write(buffer.getbuffer())


def load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only; a file that asks to
    build any other object is refused (never unpickled) with a :class:`CheckpointError`."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # UnpicklingError, a truncated zip, ...
        raise CheckpointError(f"{path}: refused to load ({first_line(exc)})") from None
