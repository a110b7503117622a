"""File safety shared by every layer: atomic files and folders, hashes, run locks.

Standard library only, so the math, model I/O, composition layers and the flows can all use it.
A writer fills a uniquely named hidden sibling of its target in the same folder, syncs it to
disk, renames it into place and syncs the parent folder: a crash, a full disk or a read-only
folder leaves the previous version or the new one, never a half-written file. Hidden siblings are
named ``.{name}{tag}...``; :func:`is_partial` recognises what a killed writer left.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "RunLockedError",
    "atomic_folder",
    "atomic_write_bytes",
    "atomic_write_text",
    "discard",
    "exclusive_run",
    "file_sha256",
    "first_line",
    "fsync_folder",
    "is_partial",
]

# Hidden siblings of a target: being written, replaced (kept until the swap is done), being
# deleted. The last two end with the writer's pid, so a live writer's folder is left alone.
TMP_TAG, OLD_TAG, DISCARD_TAG = ".tmp-", ".old-", ".discard-"
PARTIAL_TAGS = (TMP_TAG, OLD_TAG, DISCARD_TAG)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, as hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_partial(name: str, stem: str = "") -> bool:
    """Whether ``name`` is a hidden sibling that a writer of this module leaves while it works
    (being written, replaced or deleted), of a target whose name starts with ``stem``."""
    return name.startswith(f".{stem}") and any(tag in name for tag in PARTIAL_TAGS)


def fsync_folder(folder: str | Path) -> None:
    """Make the entries of ``folder`` (files created, renamed or removed in it) durable.

    File systems that cannot sync a folder (some network ones say EINVAL) are let be: the rename
    is still atomic there, only its durability after a power cut is up to them.
    """
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded with ``encoding``."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` in one step: written to a unique hidden sibling, synced,
    renamed over ``path``, then the folder is synced. On any error ``path`` is untouched and the
    sibling removed. An existing file keeps its permission bits; a new one gets the umask's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_sibling(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(handle.fileno(), stat.S_IMODE(path.stat().st_mode))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_folder(path.parent)
    return path


def _create_sibling(path: Path) -> tuple[int, Path]:
    """Create and open a new hidden sibling ``.{name}.tmp-XXXXXXXXXXXX`` of ``path``; never an
    existing file or link (``O_EXCL``), so concurrent writers cannot share one. Mode 0o666 lets
    the kernel apply the umask, as for any new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    for _ in range(100):
        candidate = path.with_name(f".{path.name}{TMP_TAG}{secrets.token_hex(6)}")
        try:
            return os.open(candidate, flags, 0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))


def atomic_folder(target: str | Path, write: Callable[[Path], object]) -> Path:
    """Run ``write(tmp)`` on a fresh temporary sibling of ``target``, then swap it into place.

    The previous ``target`` (if any) is replaced only after ``write`` has succeeded and the new
    tree is synced to disk; on any error the temporary folder is removed and ``target`` is
    untouched. The parent folder is synced after the swap.
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
        fsync_folder(target.parent)
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


def _fsync_tree(folder: Path) -> None:
    """Sync every file under ``folder``, then every folder, deepest first (links not followed)."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            path = Path(root) / name
            if path.is_symlink():
                continue
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        fsync_folder(root)


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


def discard(folder: str | Path) -> None:
    """Delete ``folder`` so that no half-deleted copy is ever visible under its name: it is
    renamed to a hidden sibling first (one atomic step), then removed."""
    folder = Path(folder)
    hidden = folder.with_name(f".{folder.name}{DISCARD_TAG}{os.getpid()}")
    folder.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


class RunLockedError(RuntimeError):
    """Another run holds the lock on the same outputs."""


@contextlib.contextmanager
def exclusive_run(lock_file: str | Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` for the duration, or refuse at once.

    Two runs writing the same checkpoints or registry would corrupt each other's work; the second
    one stops with a :class:`RunLockedError` naming the holder (pid and start time, written into
    the lock file) instead of waiting silently. The lock is an OS file lock (``flock``), so a
    killed holder releases it. The lock file is opened without following a symbolic link and
    without truncating it, and must be a plain file with one name: a link planted at its path
    cannot make a run overwrite another file.
    """
    import fcntl

    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise FileExistsError(
            f"lock file {path} is a symbolic link; remove it (it is not a "
            "lock this project made), then start again"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise FileExistsError(
                f"lock file {path} is not a plain file of its own (a hard "
                "link or a special file); remove it, then start again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise RunLockedError(
                f"another {what} is running ({holder}; lock {path}); wait for it to finish or "
                "stop it, then start again"
            ) from None
        # Ours now: record the holder for the message of a run that finds it taken.
        note = f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}".encode()
        os.pwrite(fd, note, 0)
        os.ftruncate(fd, len(note))
        yield
    finally:
        os.close(fd)
