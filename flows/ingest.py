"""New prompt files for unattended retraining: ``ppo ingest FILE...`` and the flow's inbox.

``ppo ingest`` reads each file as ``ppo prepare`` will (a malformed one is refused before
anything is written), copies them into ``ingest.inbox_dir`` (each whole or not at all) and
emits the Prefect event :data:`INGESTED_EVENT`, which triggers the deployment
``retrain/on-new-data`` (``prefect.yaml``).

Files wait in the inbox, not in ``data.raw_dir``, because a run in progress reads the raw folder
twice (``prepare``, then ``train`` checks that nothing changed since): the next run of the flow
moves them in under the retraining lock (:func:`take_inbox`), before it prepares. So files that
arrive during a run all wait for the next one, none is lost, and a run triggered for files an
earlier run already took finds no new data and ends at once (the flow's ``new_data_only``).

The event carries the file names for people and automations to read; the run trusts none of
it, it looks at the inbox and the raw folder itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.raw_data import read_raw_prompts
from ppo_core.config import Config
from ppo_core.files import (
    UnsafeCopyError,
    copy_regular_file,
    create_sibling,
    exclusive_run,
    file_sha256,
    fsync_folder,
    printable,
)
from ppo_core.prompts import PromptFileError

INGESTED_EVENT = "ppo.data.ingested"
# The resource of every ingest event: the trigger in prefect.yaml matches it.
RAW_DATA_RESOURCE = "ppo.raw-data"
SUFFIXES = (".jsonl", ".parquet")
# The inbox's lock: held by `ppo ingest` while it checks and adds files, and by a run while it
# takes them (hidden, so no run takes it).
LOCK_NAME = ".ingest.lock"


@dataclass
class Ingested:
    """What ``ppo ingest`` did: files copied into the inbox, files already there or already
    in the raw folder with the same bytes (nothing to do), and the prompts each new file holds."""

    added: list[Path] = field(default_factory=list)
    already_there: list[Path] = field(default_factory=list)
    prompts: dict[str, int] = field(default_factory=dict)


def _same_bytes(first: Path, second: Path) -> bool:
    return first.stat().st_size == second.stat().st_size and file_sha256(first) == file_sha256(
        second
    )


def ingest_files(config: Config, files: Sequence[str | Path]) -> Ingested:
    """Check ``files`` and copy them into ``ingest.inbox_dir``; all or none.

    Runs under the inbox's lock (:data:`LOCK_NAME`; a second ``ppo ingest``, or a run taking the
    inbox, waits for it), so that two commands cannot both add a file of one name. Each file is
    copied into a new hidden file of a random name in the inbox (created exclusively, so a link
    planted there cannot redirect the copy), and the copy (not the original, which may still be
    changing) is read as ``prepare`` reads raw files; only when every copy reads do they take
    their names, each as a new link that never replaces a file.

    Raises:
        PromptFileError: a file that does not exist, is a link or not a regular file, is larger
            than ``data.max_bytes_per_file`` (refused before a byte is copied), has a name with
            control characters or a suffix ``prepare`` does not read, holds no prompt or does
            not parse (naming the file and line), two files of one name, or a name already
            taken in the inbox or ``data.raw_dir`` by other bytes (ingest adds files, it never
            replaces one).
    """
    inbox = Path(config.ingest.inbox_dir)
    inbox.mkdir(parents=True, exist_ok=True)
    with exclusive_run(inbox / LOCK_NAME, "ppo ingest into this inbox", on_wait=_quiet):
        return _ingest_locked(config, files, inbox)


def _quiet(holder: str) -> None:
    """Waiting for the inbox's lock takes seconds at most: nothing to tell."""


def _checked_source(config: Config, given: str | Path) -> Path:
    """``given`` if it may be ingested: a regular file (not a link) within the size limit, its
    name printable, visible and with a suffix ``prepare`` reads."""
    path = Path(given)
    shown = printable(str(path))
    if not path.name.isprintable():
        raise PromptFileError(
            f"{shown}: the file name holds control characters (a line break, a terminal escape); "
            "rename the file"
        )
    if path.suffix not in SUFFIXES:
        raise PromptFileError(
            f"{shown}: prepare reads only {' and '.join(SUFFIXES)} files, not {path.suffix!r}"
        )
    if path.name.startswith("."):
        raise PromptFileError(f"{shown}: a hidden file name; prepare would not read it")
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise PromptFileError(f"{shown}: no such file") from None
    if stat.S_ISLNK(info.st_mode):
        raise PromptFileError(f"{shown}: a symbolic link; ingest the file it points to")
    if not stat.S_ISREG(info.st_mode):
        raise PromptFileError(f"{shown}: not a regular file")
    limit = config.data.max_bytes_per_file
    if info.st_size > limit:
        raise PromptFileError(
            f"{shown}: {info.st_size} bytes, more than data.max_bytes_per_file={limit}; "
            "split the file or raise the limit"
        )
    return path


def _ingest_locked(config: Config, files: Sequence[str | Path], inbox: Path) -> Ingested:
    raw_dir = Path(config.data.raw_dir)
    result = Ingested()
    sources: list[Path] = []
    for given in files:
        path = _checked_source(config, given)
        if any(other.name == path.name for other in sources):
            raise PromptFileError(
                f"two files named {path.name} ({printable(str(given))} and another)"
            )
        taken = [place for place in (inbox / path.name, raw_dir / path.name) if place.exists()]
        if taken and all(_same_bytes(path, place) for place in taken):
            result.already_there.append(taken[0])
            continue
        for place in taken:
            if not _same_bytes(path, place):
                raise PromptFileError(
                    f"{path}: {place} already exists with other content; ingest adds files and "
                    "never replaces one, so give the new file another name"
                )
        sources.append(path)
    if not sources:
        return result
    parts: list[tuple[Path, Path]] = []
    try:
        for path in sources:
            # Hidden (no run takes it), with the original's suffix (the reader goes by it).
            fd, part = create_sibling(inbox / path.name, suffix=path.suffix)
            parts.append((part, inbox / path.name))
            try:
                copy_regular_file(path, fd, config.data.max_bytes_per_file)
                os.fsync(fd)
            except UnsafeCopyError as exc:
                raise PromptFileError(str(exc)) from None
            finally:
                os.close(fd)
            result.prompts[path.name] = _count_prompts(config, part, path)
        for part, final in parts:
            os.link(part, final)  # FileExistsError rather than replacing a file put there
            result.added.append(final)
        fsync_folder(inbox)
    except BaseException:
        for final in result.added:  # all or none
            with contextlib.suppress(FileNotFoundError):
                final.unlink()
        result.added.clear()
        raise
    finally:
        for part, _ in parts:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
    return result


def _count_prompts(config: Config, copy: Path, original: Path) -> int:
    """The number of prompts in ``copy`` (of ``original``), read as ``prepare`` reads it; errors
    name the original."""
    try:
        prompts = read_raw_prompts(config, copy)
    except PromptFileError as exc:
        raise PromptFileError(str(exc).replace(str(copy), str(original))) from None
    if not any(p.strip() if isinstance(p, str) else p for p in prompts):
        raise PromptFileError(f"{original}: no prompts")
    return len(prompts)


def inbox_files(config: Config) -> list[Path]:
    """The files waiting in ``ingest.inbox_dir``, by name: regular files only. A link or
    anything else put there by hand is never taken (it could make ``prepare`` read a file from
    anywhere); it stays where it is."""
    inbox = Path(config.ingest.inbox_dir)
    if not inbox.is_dir():
        return []
    return sorted(
        p
        for p in inbox.iterdir()
        if p.suffix in SUFFIXES and not p.name.startswith(".") and stat.S_ISREG(p.lstat().st_mode)
    )


def take_inbox(config: Config) -> list[str]:
    """Move every file waiting in the inbox into ``data.raw_dir`` (one rename each, then both
    folders synced); returns their names. Call it holding the retraining lock.

    Raises:
        PromptFileError: a waiting file's name is taken in the raw folder by other bytes (a file
            put there by hand since it was ingested); nothing is moved.
    """
    inbox = Path(config.ingest.inbox_dir)
    if not inbox.is_dir():
        return []
    with exclusive_run(inbox / LOCK_NAME, "ppo ingest into this inbox", on_wait=_quiet):
        return _take_locked(config)


def _take_locked(config: Config) -> list[str]:
    raw_dir = Path(config.data.raw_dir)
    waiting = inbox_files(config)
    for path in waiting:
        existing = raw_dir / path.name
        if existing.exists() and not _same_bytes(path, existing):
            raise PromptFileError(
                f"{path} waits to be added to {raw_dir}, but {existing} now holds other "
                "content; rename one of them"
            )
    raw_dir.mkdir(parents=True, exist_ok=True)
    for path in waiting:
        os.replace(path, raw_dir / path.name)
    if waiting:
        fsync_folder(raw_dir)
        fsync_folder(config.ingest.inbox_dir)
    return [p.name for p in waiting]


def set_aside_rejected(config: Config, names: Sequence[str], reason: str) -> Path:
    """Move the raw files ``names`` (the ones a run took from the inbox) out of
    ``data.raw_dir`` into a new folder under ``ingest.rejected_dir``, with ``REASON.txt``
    holding ``reason``; returns the folder."""
    raw_dir = Path(config.data.raw_dir)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    folder = Path(config.ingest.rejected_dir) / stamp
    number = 1
    while folder.exists():
        number += 1
        folder = Path(config.ingest.rejected_dir) / f"{stamp}-{number}"
    folder.mkdir(parents=True)
    (folder / "REASON.txt").write_text(reason.rstrip() + "\n")
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.replace(raw_dir / name, folder / name)
    fsync_folder(folder)
    fsync_folder(raw_dir)
    return folder


def ingested_event(result: Ingested, project: Path) -> dict[str, Any]:
    """The keyword arguments of the :data:`INGESTED_EVENT` event for ``result``."""
    return {
        "event": INGESTED_EVENT,
        "resource": {
            "prefect.resource.id": RAW_DATA_RESOURCE,
            "prefect.resource.name": str(project),
        },
        "payload": {
            "files": [p.name for p in result.added],
            "prompts": sum(result.prompts.values()),
        },
    }


def emit_ingested(result: Ingested, project: Path) -> None:
    """Send the :data:`INGESTED_EVENT` event to the Prefect server ``PREFECT_API_URL`` names,
    and wait until it has been sent (a short-lived command must not exit with it queued).

    Raises:
        OSError (or Prefect's own error): the server cannot be reached.
    """
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    async def send() -> None:
        async with get_events_client(checkpoint_every=1) as client:
            await client.emit(Event(**ingested_event(result, project)))

    asyncio.run(send())
