"""Atomic files and folders (standard library only): a writer fills a uniquely named hidden
sibling of its target in the same folder, syncs it to disk, renames it into place and syncs the
parent folder, so a crash, a full disk or a read-only folder leaves the previous version or the
new one, never a half-written file. Hidden siblings are named ``.{name}{tag}...``;
:func:`is_partial` recognises what a killed writer left.

Every folder :func:`atomic_folder` writes holds a marker file (:data:`OUTPUT_MARKER`), and it
replaces only such a folder (or an empty one, or an output of a version from before the marker):
a mistyped output path cannot wipe a folder the pipeline did not write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from ppo_core.files.artifacts import (
    DATA_MANIFEST,
    EVAL_METRICS,
    EVAL_MODELS,
    EVAL_REPORT,
    EVAL_SAMPLES,
    IMPORT_RECORD,
    TINY_DEFAULT_RECORD,
    TRAINING_SUMMARY,
)

# Hidden siblings of a target: being written, replaced (kept until the swap is done), being
# deleted. The last two end with the writer's pid, so a live writer's folder is left alone.
TMP_TAG, OLD_TAG, DISCARD_TAG = ".tmp-", ".old-", ".discard-"


PARTIAL_TAGS = (TMP_TAG, OLD_TAG, DISCARD_TAG)


# Written into every folder atomic_folder writes: the folder is an output of this pipeline, which
# a later run may replace. A non-empty folder without it belongs to someone else.
OUTPUT_MARKER = ".ppo-output"


_MARKER_TEXT = (
    "This folder is an output of ppo-retrain: the pipeline replaces it when it writes it again.\n"
)


# Outputs of versions from before the marker, known by the files their writer always left:
# (names the folder holds all of, names it may hold besides; None: any). A prepared data version
# (data/interim, data/prepared), the base model built or imported by `ppo base`, a trained
# candidate, a checkpoint, and an evaluation report, of which git keeps metrics.json alone (so a
# fresh clone holds just that file there, and nothing but evaluation files is accepted).
EARLIER_OUTPUTS: tuple[tuple[frozenset[str], frozenset[str] | None], ...] = (
    (frozenset({DATA_MANIFEST, "train.parquet", "eval.parquet"}), None),
    (frozenset({TINY_DEFAULT_RECORD, "config.json"}), None),
    (frozenset({IMPORT_RECORD, "config.json"}), None),
    (frozenset({TRAINING_SUMMARY, "config.json"}), None),
    (frozenset({"trainer_state.json", "checksums.json"}), None),
    (
        frozenset({EVAL_METRICS}),
        frozenset({EVAL_METRICS, EVAL_REPORT, EVAL_SAMPLES, EVAL_MODELS}),
    ),
)


class ForeignFolderError(FileExistsError):
    """An output path holds something the pipeline did not write, which it will not replace."""


class ForeignFileError(FileExistsError):
    """An output file's path holds a file the pipeline did not write, which it will not replace."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
    fd, tmp = create_sibling(path)
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


def create_sibling(path: Path, suffix: str = "") -> tuple[int, Path]:
    """Create and open (for writing) a new hidden sibling ``.{name}.tmp-XXXXXXXXXXXX{suffix}`` of
    ``path``, its name random; never an existing file or link (``O_EXCL``), so neither a
    concurrent writer nor a link planted in the folder can take its place. Mode 0o666 lets the
    kernel apply the umask, as for any new file. Returns the descriptor and the path."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    for _ in range(100):
        candidate = path.with_name(f".{path.name}{TMP_TAG}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(candidate, flags, 0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))


def atomic_folder(target: str | Path, write: Callable[[Path], object]) -> Path:
    """Run ``write(tmp)`` on a fresh temporary sibling of ``target``, then swap it into place.

    The previous ``target`` (if any) is replaced only after ``write`` has succeeded and the new
    tree is synced to disk; on any error the temporary folder is removed and ``target`` is
    untouched. The parent folder is synced after the swap. The new folder holds
    :data:`OUTPUT_MARKER`; an existing ``target`` that is not an output of the pipeline is never
    replaced (:func:`check_replaceable`, checked before ``write`` runs and again before the swap).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _restore_interrupted_swap(target)
    check_replaceable(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_TAG}", dir=target.parent))
    try:
        write(tmp)
        mark_output(tmp)
        fsync_tree(tmp)
        # Again: a folder may have appeared under that name while ``write`` ran.
        check_replaceable(target)
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


def check_replaceable(target: str | Path) -> None:
    """Raise :class:`ForeignFolderError` unless :func:`atomic_folder` may replace ``target``.

    It may when nothing is there, or an empty folder, or a folder that holds
    :data:`OUTPUT_MARKER` or the files of an output of a version from before the marker
    (:data:`EARLIER_OUTPUTS`). A file, a symbolic link (even to a folder) or any other non-empty
    folder is refused: replacing it would delete what someone else keeps there.
    """
    target = Path(target)
    try:
        info = target.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        what = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        what = "is a file, not a folder"
    else:
        with os.scandir(target) as entries:
            names = {entry.name for entry in entries}
        if not names or OUTPUT_MARKER in names:
            return
        for required, allowed in EARLIER_OUTPUTS:
            if names >= required and (allowed is None or names <= allowed):
                return
        what = f"is a folder the pipeline did not write (it has no {OUTPUT_MARKER} file)"
    raise ForeignFolderError(
        f"{printable(str(target))} {what}; refusing to replace it with an output: move it "
        "away or choose another path for this output"
    )


def check_replaceable_file(
    path: str | Path, key: str, what: str, written_here: Callable[[bytes], bool]
) -> None:
    """Raise :class:`ForeignFileError` unless the output file ``path`` (config key ``key``) is
    absent or is a regular file that ``written_here`` recognises as ``what`` the pipeline wrote
    there before: a project file named as an output by mistake (``promote.report=Makefile``), a
    link, or anything else is never replaced. Outputs of 16 MiB or more are never recognised."""
    path = Path(path)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    recognised = False
    if stat.S_ISREG(info.st_mode) and info.st_size < 1 << 24:
        recognised = written_here(path.read_bytes())
    if not recognised:
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else f"not {what}"
        raise ForeignFileError(
            f"{key}={printable(str(path))!r} exists and is {kind} this pipeline wrote; refusing "
            f"to replace it: move it away or choose another {key}"
        )


def mark_output(folder: Path) -> None:
    """Write :data:`OUTPUT_MARKER` into ``folder``; an entry of that name that ``write`` made (a
    copied output's marker, or a link) is replaced, never written through."""
    marker = folder / OUTPUT_MARKER
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    marker.write_text(_MARKER_TEXT)


def printable(text: str) -> str:
    """``text`` with control characters escaped, so that a message stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def fsync_tree(folder: Path) -> None:
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
    if target.exists() or target.is_symlink():
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


def remove_links(folder: str | Path) -> list[str]:
    """Remove every symbolic link under the output folder ``folder`` (never following one);
    return their paths relative to it, sorted.

    Call it before handing an output folder to a library that writes or cleans up in it
    (DVCLive, Great Expectations, matplotlib): the folder's own path is checked where the config
    is loaded, but a link planted inside it would make the library write or delete where it
    points."""
    root = Path(folder)
    removed: list[str] = []
    if root.is_symlink() or not root.is_dir():
        return removed
    for current, folders, files in os.walk(root):  # os.walk does not enter linked folders
        for name in [*folders, *files]:
            path = Path(current) / name
            if path.is_symlink():
                path.unlink()
                removed.append(str(path.relative_to(root)))
    return sorted(removed)


def clear_output_folder(folder: str | Path) -> None:
    """Remove the output folder ``folder`` with everything in it, so that a library builds it
    anew: a symbolic link at its place is removed itself, never followed, and so is any link
    inside it (``shutil.rmtree`` unlinks those)."""
    path = Path(folder)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def discard(folder: str | Path) -> None:
    """Delete ``folder`` so that no half-deleted copy is ever visible under its name: it is
    renamed to a hidden sibling first (one atomic step), then removed."""
    folder = Path(folder)
    hidden = folder.with_name(f".{folder.name}{DISCARD_TAG}{os.getpid()}")
    folder.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)
