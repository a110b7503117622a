"""Safe copies of model folders (standard library only): regular files only, within a size
cap (:data:`MAX_COPY_BYTES`); a link counts as a file only where it resolves directly into a Hugging
Face cache repository's own ``blobs/``, and any other link or special file is refused by name.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ppo_core.files.atomic import printable

# Largest model folder copy_regular_tree copies (bytes, 200 GB: beyond the largest models one
# machine trains here), so that a folder that only looks like a model cannot fill the disk.
MAX_COPY_BYTES = 200 * 10**9


class UnsafeCopyError(FileExistsError):
    """A folder to copy holds a link or a special file, or more bytes than allowed."""


# What stat calls each kind of entry that copy_regular_tree refuses.
_SPECIAL_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def entry_kind(path: str | Path) -> str | None:
    """What ``path`` is when it is not a regular file, links followed ("a FIFO", "a folder (through
    a link)", "a link to nothing"), else None: said before anything opens it, since reading a
    FIFO or a device blocks or never ends."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing"
    if stat.S_ISREG(mode):
        return None
    kind = "a folder" if stat.S_ISDIR(mode) else _SPECIAL_KINDS.get(stat.S_IFMT(mode))
    kind = kind or "not a regular file"
    return f"{kind} (through a link)" if path.is_symlink() else kind


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
