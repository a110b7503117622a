"""Run locks (standard library only): one run of a kind at a time on one folder, a second one
refused at once with the holder's pid, a lock a killed run left taken over."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class RunLockedError(RuntimeError):
    """Another run holds the lock on the same outputs."""


@contextlib.contextmanager
def exclusive_run(
    lock_file: str | Path, what: str, on_wait: Callable[[str], object] | None = None
) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` for the duration, or refuse at once; with
    ``on_wait``, wait for it instead, after calling ``on_wait`` with the holder's note.

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
            if on_wait is not None:
                on_wait(f"another {what} is running ({holder}; lock {path})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                raise RunLockedError(
                    f"another {what} is running ({holder}; lock {path}); wait for it to finish "
                    "or stop it, then start again"
                ) from None
        # Ours now: record the holder for the message of a run that finds it taken.
        note = f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}".encode()
        os.pwrite(fd, note, 0)
        os.ftruncate(fd, len(note))
        yield
    finally:
        os.close(fd)
