"""File safety shared by every layer: atomic files and folders, safe copies, hashes, run locks.

Standard library only, so the math, model I/O, composition layers and the flows can all use it.
A writer fills a uniquely named hidden sibling of its target in the same folder, syncs it to
disk, renames it into place and syncs the parent folder: a crash, a full disk or a read-only
folder leaves the previous version or the new one, never a half-written file. Hidden siblings are
named ``.{name}{tag}...``; :func:`is_partial` recognises what a killed writer left.

Every folder :func:`atomic_folder` writes holds a marker file (:data:`OUTPUT_MARKER`), and it
replaces only such a folder (or an empty one, or an output of a version from before the marker):
a mistyped output path cannot wipe a folder the pipeline did not write. Model folders are copied
with :func:`copy_regular_tree`: regular files only, within a size cap.
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
    "MAX_COPY_BYTES",
    "OUTPUT_MARKER",
    "ForeignFolderError",
    "RunLockedError",
    "UnsafeCopyError",
    "atomic_folder",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_replaceable",
    "copy_regular_tree",
    "discard",
    "exclusive_run",
    "file_sha256",
    "first_line",
    "folder_fingerprint",
    "fsync_folder",
    "is_partial",
    "regular_files",
    "tree_sha256",
]

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
    (frozenset({"manifest.json", "train.parquet", "eval.parquet"}), None),
    (frozenset({"tiny_default.json", "config.json"}), None),
    (frozenset({"imported_from.json", "config.json"}), None),
    (frozenset({"training_summary.json", "config.json"}), None),
    (frozenset({"trainer_state.json", "checksums.json"}), None),
    (
        frozenset({"metrics.json"}),
        frozenset({"metrics.json", "report.md", "samples.json", "models.json"}),
    ),
)

# Largest model folder copy_regular_tree copies (bytes, 200 GB: beyond the largest models one
# machine trains here), so that a folder that only looks like a model cannot fill the disk.
MAX_COPY_BYTES = 200 * 10**9


class ForeignFolderError(FileExistsError):
    """An output path holds something the pipeline did not write, which it will not replace."""


class ForeignFileError(FileExistsError):
    """An output file's path holds a file the pipeline did not write, which it will not replace."""


class UnsafeCopyError(FileExistsError):
    """A folder to copy holds a link or a special file, or more bytes than allowed."""


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
        _mark_output(tmp)
        _fsync_tree(tmp)
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


def _mark_output(folder: Path) -> None:
    """Write :data:`OUTPUT_MARKER` into ``folder``; an entry of that name that ``write`` made (a
    copied output's marker, or a link) is replaced, never written through."""
    marker = folder / OUTPUT_MARKER
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    marker.write_text(_MARKER_TEXT)


def printable(text: str) -> str:
    """``text`` with control characters escaped, so that a message stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


# What stat calls each kind of entry that copy_regular_tree refuses.
_SPECIAL_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _scan(
    root: Path, max_bytes: int | None, link_root: Path | None = None
) -> tuple[list[str], list[tuple[str, int]], dict[str, Path]]:
    """The folders and regular files under ``root`` (paths relative to it, with ``/``, sorted),
    and the links among those files with the real file each stands for; raise
    :class:`UnsafeCopyError` for any other entry or when the files hold more than ``max_bytes``
    (``None``: :data:`MAX_COPY_BYTES`). A link counts as a file only when it resolves to a
    regular file directly inside ``link_root`` (a hub cache's ``blobs/``); no other is followed."""
    cap = MAX_COPY_BYTES if max_bytes is None else max_bytes
    if not root.is_dir():
        raise FileNotFoundError(f"{printable(str(root))} is not a folder")
    folders: list[str] = []
    found: list[tuple[str, int]] = []
    targets: dict[str, Path] = {}
    pending = [""]  # a stack, not recursion: a deeply nested tree cannot exhaust Python's stack
    while pending:
        prefix = pending.pop()
        with os.scandir(root / prefix if prefix else root) as entries:
            listed = sorted(entries, key=lambda entry: entry.name)
        for entry in listed:
            relative = f"{prefix}{entry.name}"
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                folders.append(relative)
                pending.append(f"{relative}/")
            elif stat.S_ISREG(mode):
                found.append((relative, entry.stat(follow_symlinks=False).st_size))
            elif (target := _link_into(Path(entry.path), link_root)) is not None:
                targets[relative] = target
                found.append((relative, target.stat().st_size))
            else:
                kind = _SPECIAL_KINDS.get(stat.S_IFMT(mode), "not a regular file")
                raise UnsafeCopyError(
                    f"refusing to copy {printable(str(root))}: {printable(relative)} is {kind}; "
                    "only regular files and folders are copied (a link can point at a private "
                    "file or a device): put the file itself there (e.g. copy with `cp -rL`) or "
                    "remove the entry"
                )
    total = sum(size for _, size in found)
    if total > cap:
        raise UnsafeCopyError(
            f"refusing to copy {printable(str(root))}: its files hold {total} bytes, more than "
            f"the {cap} bytes allowed (ppo_core.files.MAX_COPY_BYTES); nothing was copied"
        )
    return sorted(folders), sorted(found), targets


def _link_into(link: Path, link_root: Path | None) -> Path | None:
    """The regular file directly inside ``link_root`` that the link ``link`` resolves to, or
    ``None`` (not a link, no ``link_root``, or a link anywhere else)."""
    if link_root is None or not link.is_symlink():
        return None
    target = Path(os.path.realpath(link))
    if target.parent != Path(os.path.realpath(link_root)):
        return None
    return target if stat.S_ISREG(os.lstat(target).st_mode) else None


def regular_files(
    folder: str | Path, max_bytes: int | None = None, link_root: Path | None = None
) -> list[tuple[str, int]]:
    """Every regular file under ``folder`` as (path relative to it with ``/``, size in bytes),
    sorted; :class:`UnsafeCopyError` for a link, a device, a FIFO or a socket anywhere in the
    tree, or for more than ``max_bytes`` in all (``None``: :data:`MAX_COPY_BYTES`). A link that
    resolves to a regular file directly inside ``link_root`` counts as that file."""
    return _scan(Path(folder), max_bytes, link_root)[1]


def copy_regular_tree(
    source: str | Path,
    dest: str | Path,
    max_bytes: int | None = None,
    link_root: Path | None = None,
) -> list[tuple[str, int]]:
    """Copy the folder tree ``source`` into the folder ``dest`` (made when missing); return the
    files copied as :func:`regular_files` lists them.

    The whole tree is checked before the first byte is copied: a symbolic link (which could make
    a copy of a model folder take a private key along, or read ``/dev/zero`` for ever), a device,
    a FIFO or a socket, or more than ``max_bytes`` in all (``None``: :data:`MAX_COPY_BYTES`),
    refuses the copy with one :class:`UnsafeCopyError` naming the entry or the size. Each file is
    then opened without following links and copied up to the size it had when checked: a file
    replaced or grown meanwhile is refused too. Files keep their permission bits (rwx only).
    With ``link_root`` (the ``blobs/`` folder of a hub cache snapshot), a link that resolves to a
    regular file directly inside it is copied as that file.
    """
    root, dest = Path(source), Path(dest)
    folders, found, targets = _scan(root, max_bytes, link_root)
    dest.mkdir(parents=True, exist_ok=True)
    for relative in folders:
        (dest / relative).mkdir(exist_ok=True)
    for relative, size in found:
        _copy_file(root, relative, size, dest / relative, targets.get(relative))
    return found


def _copy_file(
    root: Path, relative: str, size: int, dest: Path, target: Path | None = None
) -> None:
    def changed(how: str) -> UnsafeCopyError:
        return UnsafeCopyError(
            f"refusing to copy {printable(str(root))}: {printable(relative)} changed while it "
            f"was copied ({how}); copy the folder again when nothing writes to it"
        )

    # O_NONBLOCK: should a FIFO have taken the file's place, opening it does not wait for a writer.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        source_fd = os.open(target or root / relative, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise changed("it became a symbolic link") from None
        raise
    try:
        info = os.fstat(source_fd)
        if not stat.S_ISREG(info.st_mode):
            raise changed("it is no longer a regular file")
        dest_flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dest_fd = os.open(dest, dest_flags, 0o600)
        try:
            _copy_bytes(source_fd, dest_fd, size)
            os.fchmod(dest_fd, stat.S_IMODE(info.st_mode) & 0o777)
        finally:
            os.close(dest_fd)
        if os.pread(source_fd, 1, size):
            raise changed(f"it grew past the {size} bytes it had")
    finally:
        os.close(source_fd)


def copy_regular_file(source: str | Path, dest_fd: int, max_bytes: int) -> int:
    """Copy the regular file ``source`` into the open file ``dest_fd``; return its size.

    ``source`` is opened without following a link, and refused with :class:`UnsafeCopyError`
    before a byte is copied when it is a link, not a regular file, or larger than ``max_bytes``;
    a file that grows while it is copied is refused too."""
    source = Path(source)
    name = printable(str(source))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        source_fd = os.open(source, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCopyError(
                f"{name} is a symbolic link; give the file it points to"
            ) from None
        raise
    try:
        info = os.fstat(source_fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeCopyError(f"{name} is not a regular file")
        if info.st_size > max_bytes:
            raise UnsafeCopyError(f"{name} holds {info.st_size} bytes, more than {max_bytes}")
        _copy_bytes(source_fd, dest_fd, info.st_size)
        if os.pread(source_fd, 1, info.st_size):
            raise UnsafeCopyError(
                f"{name} grew while it was copied; copy it when nothing writes to it"
            )
        return info.st_size
    finally:
        os.close(source_fd)


def _copy_bytes(source_fd: int, dest_fd: int, size: int) -> None:
    """Copy at most the first ``size`` bytes of ``source_fd`` (fewer if it shrank) to
    ``dest_fd``, in the kernel (``sendfile``) where it can."""
    offset, use_sendfile = 0, hasattr(os, "sendfile")
    while offset < size:
        count = min(size - offset, 1 << 26)
        if use_sendfile:
            try:
                sent = os.sendfile(dest_fd, source_fd, offset, count)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                use_sendfile = False  # a file system without it: copy through memory
                continue
        else:
            data = memoryview(os.pread(source_fd, count, offset))
            sent = len(data)
            while data:
                data = data[os.write(dest_fd, data) :]
        if sent == 0:
            return
        offset += sent


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


def folder_fingerprint(folder: str | Path) -> str:
    """SHA-256 (hex) that tells model folders apart without reading their weights: the bytes of
    ``config.json`` (empty when missing), then each regular file's relative path and size, in
    order. Two copies of one folder match; a changed config or a file of another size does not.
    """
    digest = hashlib.sha256()
    config = Path(folder) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for relative, size in regular_files(folder):
        digest.update(f"\0{relative}\0{size}".encode())
    return digest.hexdigest()


def tree_sha256(folder: str | Path) -> str:
    """SHA-256 (hex) of a folder's whole content, unlike :func:`folder_fingerprint`: each regular
    file's relative path and the SHA-256 of its bytes, in :func:`regular_files` order (which
    refuses links and special files). Equal for a byte-identical copy anywhere."""
    digest = hashlib.sha256()
    for relative, _ in regular_files(folder):
        digest.update(f"{relative}\0{file_sha256(Path(folder) / relative)}\n".encode())
    return digest.hexdigest()


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
