"""Atomic, resumable checkpoints (layer 2).

A checkpoint is a folder ``step-000040/`` holding the model (``model/``: ``save_pretrained``
safetensors, tokenizer, value head), the optimizer and scheduler states, ``trainer_state.json``
(iteration, KL coefficient, lineage) and ``checksums.json`` (SHA-256 of every file). It is written
into a hidden temporary folder and renamed into place, so a crash never leaves a half checkpoint,
and loaded with ``torch.load(weights_only=True)``: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "RunLockedError",
    "atomic_folder",
    "discard",
    "exclusive_run",
    "file_sha256",
    "first_line",
    "latest_checkpoint",
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
# Hidden siblings a writer makes: being written, replaced (kept until the swap), being deleted.
TMP_TAG, OLD_TAG, DISCARD_TAG = ".tmp-", ".old-", ".discard-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_folder(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a fresh temporary sibling of ``target``, then swap it into place.

    The previous ``target`` (if any) is replaced only after ``write`` has succeeded; on any error
    the temporary folder is removed and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _restore_interrupted_swap(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_TAG}", dir=target.parent))
    try:
        write(tmp)
        _fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}{OLD_TAG}{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # Writers in other languages (safetensors) report a full disk as "... (os error 28)":
        # raise it as the OSError it is, so callers can tell a full disk from a bug.
        code = re.search(r"\(os error (\d+)\)", str(exc)) if not isinstance(exc, OSError) else None
        if code:
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(target)) from exc
        raise
    return target


def _restore_interrupted_swap(target: Path) -> None:
    """A writer killed between its two renames left ``target`` missing and the previous version
    under ``.{name}.old-{pid}``: put that version back (unless its writer is still alive)."""
    if target.exists():
        return
    for old in sorted(target.parent.glob(f".{target.name}{OLD_TAG}*")):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        old.rename(target)
        return


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discard(folder: Path) -> None:
    """Delete ``folder`` so that no half-deleted copy is ever visible under its name: it is
    renamed to a hidden sibling first (one atomic step), then removed."""
    hidden = folder.with_name(f".{folder.name}{DISCARD_TAG}{os.getpid()}")
    folder.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def remove_partial(checkpoint_dir: str | Path) -> list[str]:
    """Remove what killed writers left in ``checkpoint_dir``: hidden temporary, replaced and
    half-deleted checkpoint folders. Call it only while holding the run lock. Returns their names.
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        name = path.name
        if name.startswith(f".{STEP_PREFIX}") and any(
                tag in name for tag in (TMP_TAG, OLD_TAG, DISCARD_TAG)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return sorted(removed)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


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
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if file_sha256(path) != expected:
            raise CheckpointError(f"checkpoint {folder}: {name} is damaged (checksum mismatch)")


def save_checkpoint(
    checkpoint_dir: str | Path,
    iteration: int,
    save_model: Callable[[Path], None],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-{iteration:06d}`` atomically and keep the newest ``keep``."""
    checkpoint_dir = Path(checkpoint_dir)

    def write(tmp: Path) -> None:
        save_model(tmp / MODEL_DIR)
        _save_tensors(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            _save_tensors(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=1))
        _write_checksums(tmp)

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


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``checkpoint_dir``, or ``None``."""
    found = list_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def load_latest_good(checkpoint_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None,
                                                       list[str]]:
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
    """Verify and read a checkpoint: ``state``, ``optimizer``, ``scheduler`` and the model path."""
    folder = Path(folder)
    verify_checksums(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    optimizer = _load_tensors(folder / "optimizer.pt")
    scheduler_file = folder / "scheduler.pt"
    scheduler = _load_tensors(scheduler_file) if scheduler_file.is_file() else None
    return {"state": state, "optimizer": optimizer, "scheduler": scheduler,
            "model_dir": folder / MODEL_DIR}


def _save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, then one plain file write: a full disk or a read-only
    folder raises ``OSError`` with its errno (torch's own writer reports those as a bare
    ``RuntimeError: iostream error``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with path.open("wb") as handle:
        handle.write(buffer.getbuffer())


def _load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only; a file that asks to
    build any other object is refused (never unpickled) with a :class:`CheckpointError`."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # UnpicklingError, a truncated zip, ...
        raise CheckpointError(f"{path}: refused to load ({first_line(exc)})") from None


class RunLockedError(RuntimeError):
    """Another run holds the lock on the same outputs."""


@contextlib.contextmanager
def exclusive_run(lock_file: str | Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` for the duration, or refuse at once.

    Two runs writing the same checkpoints or registry would corrupt each other's work; the second
    one stops with a message naming the holder instead of waiting silently. The lock is an OS
    file lock, so a killed holder releases it.
    """
    import fcntl

    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunLockedError(
                f"another {what} is running ({holder}; lock {path}); wait for it to finish or "
                "stop it, then start again"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
        handle.flush()
        yield
    finally:
        handle.close()
