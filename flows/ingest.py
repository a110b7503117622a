"""New files for unattended retraining: ``ppo ingest FILE...`` (prompt files),
``ppo ingest --feedback FILE...`` (preference feedback files) and the flow's two inboxes.

``ppo ingest`` reads each file as ``ppo prepare`` will (a malformed one is refused before
anything is written), copies them into their inbox (each whole or not at all) and emits a
Prefect event that triggers a deployment (``prefect.yaml``):

- prompt files wait in ``ingest.inbox_dir`` for ``data.raw_dir``; the event
  :data:`INGESTED_EVENT` on the resource :data:`RAW_DATA_RESOURCE` starts
  ``retrain/on-new-data``;
- feedback files wait in ``ingest.feedback_inbox_dir`` for ``data.feedback_dir``; the event
  :data:`FEEDBACK_INGESTED_EVENT` on the resource :data:`FEEDBACK_RESOURCE` starts
  ``retrain/on-new-feedback``.

Files wait in an inbox, not where ``prepare`` reads them, because a run in progress reads those
folders more than once (``prepare``, then ``train`` checks that nothing changed since): the next
run of the flow moves both inboxes in under the retraining lock (:func:`take_inboxes`), before it
prepares. So files that arrive during a run all wait for the next one, none is lost, and a run
triggered for files an earlier run already took finds no new data and ends at once (the flow's
``new_data_only``).

The event carries the file names for people and automations to read; the run trusts none of
it, it looks at the inboxes and the data folders itself.
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

from flows.raw_data import (
    SUFFIXES,
    kinds_found,
    read_raw_prompts,
    read_raw_references,
    row_kinds,
)
from ppo_core.config import Config
from ppo_core.feedback.fields import FeedbackFileError
from ppo_core.feedback.rows import load_feedback_file
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
# The resource of every prompt ingest event: the trigger of on-new-data in prefect.yaml matches it.
RAW_DATA_RESOURCE = "ppo.raw-data"
FEEDBACK_INGESTED_EVENT = "ppo.feedback.ingested"
# The resource of every feedback ingest event: the trigger of on-new-feedback matches it.
FEEDBACK_RESOURCE = "ppo.feedback"
# An inbox's lock: held by `ppo ingest` while it checks and adds files, and by a run while it
# takes them (hidden, so no run takes it).
LOCK_NAME = ".ingest.lock"


@dataclass(frozen=True)
class Inbox:
    """One kind of file ``ppo ingest`` adds: the inbox it waits in (a key of ``ingest``), the
    folder a run moves it to (a key of ``data``), the event that tells Prefect and the
    deployment that event starts."""

    kind: str
    inbox_key: str
    target_key: str
    event: str
    resource: str
    deployment: str

    def folder(self, config: Config) -> Path:
        """The inbox."""
        return Path(str(getattr(config.ingest, self.inbox_key)))

    def target(self, config: Config) -> Path:
        """Where a run moves the waiting files (``data.raw_dir``, ``data.feedback_dir``)."""
        return Path(str(getattr(config.data, self.target_key)))

    def error(self, message: str) -> PromptFileError:
        """The error a refused file of this kind raises (a feedback one is a
        :class:`~ppo_core.feedback.fields.FeedbackFileError`, itself a ``PromptFileError``)."""
        return FeedbackFileError(message) if self.kind == "feedback" else PromptFileError(message)


PROMPTS = Inbox(
    "prompt", "inbox_dir", "raw_dir", INGESTED_EVENT, RAW_DATA_RESOURCE, "retrain/on-new-data"
)
FEEDBACK = Inbox(
    "feedback",
    "feedback_inbox_dir",
    "feedback_dir",
    FEEDBACK_INGESTED_EVENT,
    FEEDBACK_RESOURCE,
    "retrain/on-new-feedback",
)
# In the order a run takes them (and their locks).
INBOXES = (PROMPTS, FEEDBACK)


@dataclass
class Ingested:
    """What ``ppo ingest`` did: files copied into the inbox, files already there or already
    in the data folder with the same bytes (nothing to do), and what each new file holds:
    prompts (a prompt file), pairs and ratings (a feedback file)."""

    added: list[Path] = field(default_factory=list)
    already_there: list[Path] = field(default_factory=list)
    prompts: dict[str, int] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)
    ratings: dict[str, int] = field(default_factory=dict)
    inbox: Inbox = PROMPTS

    def holds(self, name: str) -> str:
        """What the added file ``name`` holds, for people: ``3 prompts``, ``2 pairs, 1 rating``."""
        if self.inbox == FEEDBACK:
            return f"{_count(self.pairs[name], 'pair')}, {_count(self.ratings[name], 'rating')}"
        return f"{self.prompts[name]} prompts"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


@dataclass(frozen=True)
class Taken:
    """The names of the files a run took from the inboxes: prompt files (now in
    ``data.raw_dir``) and feedback files (now in ``data.feedback_dir``)."""

    prompts: list[str] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompts or self.feedback)

    def names(self) -> list[str]:
        """Every file, a feedback file as ``feedback/NAME`` (where a rejected one is set aside)."""
        return [*self.prompts, *(f"{FEEDBACK_ASIDE}/{name}" for name in self.feedback)]


# The folder of a rejected run's feedback files inside its folder of ingest.rejected_dir.
FEEDBACK_ASIDE = "feedback"


def _same_bytes(first: Path, second: Path) -> bool:
    return first.stat().st_size == second.stat().st_size and file_sha256(first) == file_sha256(
        second
    )


def ingest_files(config: Config, files: Sequence[str | Path], inbox: Inbox = PROMPTS) -> Ingested:
    """Check ``files`` and copy them into ``inbox`` (prompt files into ``ingest.inbox_dir``,
    with :data:`FEEDBACK` feedback files into ``ingest.feedback_inbox_dir``); all or none.

    Runs under the inbox's lock (:data:`LOCK_NAME`; a second ``ppo ingest``, or a run taking the
    inbox, waits for it), so that two commands cannot both add a file of one name. Each file is
    copied into a new hidden file of a random name in the inbox (created exclusively, so a link
    planted there cannot redirect the copy), and the copy (not the original, which may still be
    changing) is read as ``prepare`` reads raw files (feedback files); only when every copy
    reads do they take their names, each as a new link that never replaces a file.

    Raises:
        PromptFileError: a file that does not exist, is a link or not a regular file, is larger
            than ``data.max_bytes_per_file`` (refused before a byte is copied), has a name with
            control characters or a suffix ``prepare`` does not read, holds no prompt (no
            feedback row) or does not parse (naming the file and line), two files of one name,
            or a name already taken in the inbox or the folder the run moves it to
            (``data.raw_dir``, ``data.feedback_dir``) by other bytes (ingest adds files, it
            never replaces one). For feedback, a :class:`~ppo_core.feedback.fields.FeedbackFileError`.
    """
    folder = inbox.folder(config)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_run(folder / LOCK_NAME, "ppo ingest into this inbox", on_wait=_quiet):
        return _ingest_locked(config, files, inbox)


def _quiet(holder: str) -> None:
    """Waiting for the inbox's lock takes seconds at most: nothing to tell."""


def _checked_source(config: Config, given: str | Path, inbox: Inbox = PROMPTS) -> Path:
    """``given`` if it may be ingested: a regular file (not a link) within the size limit, its
    name printable, visible and with a suffix ``prepare`` reads."""
    path = Path(given)
    shown = printable(str(path))
    error = inbox.error
    if not path.name.isprintable():
        raise error(
            f"{shown}: the file name holds control characters (a line break, a terminal escape); "
            "rename the file"
        )
    if path.suffix not in SUFFIXES:
        raise error(
            f"{shown}: prepare reads only {' and '.join(SUFFIXES)} files, not {path.suffix!r}"
        )
    if path.name.startswith("."):
        raise error(f"{shown}: a hidden file name; prepare would not read it")
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise error(f"{shown}: no such file") from None
    if stat.S_ISLNK(info.st_mode):
        raise error(f"{shown}: a symbolic link; ingest the file it points to")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{shown}: not a regular file")
    limit = config.data.max_bytes_per_file
    if info.st_size > limit:
        raise error(
            f"{shown}: {info.st_size} bytes, more than data.max_bytes_per_file={limit}; "
            "split the file or raise the limit"
        )
    return path


def _ingest_locked(config: Config, files: Sequence[str | Path], inbox: Inbox) -> Ingested:
    folder = inbox.folder(config)
    target = inbox.target(config)
    error = inbox.error
    result = Ingested(inbox=inbox)
    sources: list[Path] = []
    for given in files:
        path = _checked_source(config, given, inbox)
        if any(other.name == path.name for other in sources):
            raise error(f"two files named {path.name} ({printable(str(given))} and another)")
        taken = [place for place in (folder / path.name, target / path.name) if place.exists()]
        if taken and all(_same_bytes(path, place) for place in taken):
            result.already_there.append(taken[0])
            continue
        for place in taken:
            if not _same_bytes(path, place):
                raise error(
                    f"{path}: {place} already exists with other content; ingest adds files and "
                    "never replaces one, so give the new file another name"
                )
        sources.append(path)
    if not sources:
        return result
    parts: list[tuple[Path, Path]] = []
    kinds: dict[str, set[bool]] = {}
    try:
        for path in sources:
            # Hidden (no run takes it), with the original's suffix (the reader goes by it).
            fd, part = create_sibling(folder / path.name, suffix=path.suffix)
            parts.append((part, folder / path.name))
            try:
                copy_regular_file(path, fd, config.data.max_bytes_per_file)
                os.fsync(fd)
            except UnsafeCopyError as exc:
                raise error(str(exc)) from None
            finally:
                os.close(fd)
            if inbox == FEEDBACK:
                result.pairs[path.name], result.ratings[path.name] = _count_feedback(
                    config, part, path
                )
            else:
                result.prompts[path.name] = _count_prompts(config, part, path)
            kinds[path.name] = row_kinds(config, part, inbox == FEEDBACK)
        _check_one_kind(config, inbox, kinds, {path.name for path in sources})
        for part, final in parts:
            os.link(part, final)  # FileExistsError rather than replacing a file put there
            result.added.append(final)
        fsync_folder(folder)
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


def _check_one_kind(
    config: Config, inbox: Inbox, new: dict[str, set[bool]], names: set[str]
) -> None:
    """The new files with the files already in the inbox and in the folder they join: one kind
    of rows (plain or chat) in all, as ``prepare`` requires of a version; else an error naming
    a new file and a file of the other kind."""
    folders = (inbox.folder(config), inbox.target(config))
    found = kinds_found(config, new, folders, names, inbox == FEEDBACK)
    if len(found) > 1:
        raise inbox.error(
            f"{found[True]} holds chat rows ('messages') and {found[False]} plain prompts: "
            f"prepare would refuse the folder {inbox.target(config)} with both (a version holds "
            "one kind); write the plain prompts as chats with one user turn, or keep them apart"
        )


def _count_prompts(config: Config, copy: Path, original: Path) -> int:
    """The number of prompts in ``copy`` (of ``original``), read as ``prepare`` reads it, with
    their ``data.reference_fields``; errors name the original."""
    try:
        prompts = read_raw_prompts(config, copy)
        read_raw_references(config, copy)  # a row without its answer is refused here
    except PromptFileError as exc:
        raise PromptFileError(str(exc).replace(str(copy), str(original))) from None
    if not any(p.strip() if isinstance(p, str) else p for p in prompts):
        raise PromptFileError(f"{original}: no prompts")
    return len(prompts)


def _count_feedback(config: Config, copy: Path, original: Path) -> tuple[int, int]:
    """The pair rows and the rating rows in ``copy`` (of ``original``), read as ``prepare``
    reads a feedback file; errors name the original."""
    data = config.data
    try:
        pairs, ratings = load_feedback_file(
            copy, max_rows=data.max_rows_per_file, max_bytes=data.max_bytes_per_file
        )
    except FeedbackFileError as exc:
        message = str(exc).replace(printable(str(copy)), printable(str(original)))
        raise FeedbackFileError(message) from None
    if not pairs and not ratings:
        raise FeedbackFileError(
            f"{printable(str(original))}: no feedback: a feedback file holds pair rows (chosen, "
            "rejected) or rating rows (response, rating)"
        )
    return len(pairs), len(ratings)


def inbox_files(config: Config, inbox: Inbox = PROMPTS) -> list[Path]:
    """The files waiting in ``inbox`` (``ingest.inbox_dir``, ``ingest.feedback_inbox_dir``), by
    name: regular files only. A link or anything else put there by hand is never taken (it could
    make ``prepare`` read a file from anywhere); it stays where it is."""
    folder = inbox.folder(config)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.suffix in SUFFIXES and not p.name.startswith(".") and stat.S_ISREG(p.lstat().st_mode)
    )


def take_inbox(config: Config, inbox: Inbox = PROMPTS) -> list[str]:
    """Move every file waiting in ``inbox`` into its data folder (prompt files into
    ``data.raw_dir``, feedback files into ``data.feedback_dir``: one rename each, then both
    folders synced); returns their names. Call it holding the retraining lock; a run takes both
    inboxes at once (:func:`take_inboxes`).

    Raises:
        PromptFileError: a waiting file's name is taken in the data folder by other bytes (a
            file put there by hand since it was ingested); nothing is moved.
    """
    taken = take_inboxes(config, (inbox,))
    return taken.feedback if inbox == FEEDBACK else taken.prompts


def take_inboxes(config: Config, inboxes: Sequence[Inbox] = INBOXES) -> Taken:
    """Move every file waiting in the prompt and the feedback inbox into its data folder, each
    inbox under its lock (:data:`LOCK_NAME`, taken in the order of :data:`INBOXES`); returns
    their names. Every waiting file is checked before any moves, so an inbox whose file cannot
    move holds up the other's too. Call it holding the retraining lock.

    Raises:
        PromptFileError: a waiting file's name is taken in its data folder by other bytes (a
            file put there by hand since it was ingested); nothing is moved.
    """
    with contextlib.ExitStack() as locks:
        waiting: dict[Inbox, list[Path]] = {}
        for inbox in inboxes:
            folder = inbox.folder(config)
            if not folder.is_dir():
                continue
            locks.enter_context(
                exclusive_run(folder / LOCK_NAME, "ppo ingest into this inbox", on_wait=_quiet)
            )
            waiting[inbox] = _movable(config, inbox)
        for inbox, files in waiting.items():
            _move(config, inbox, files)
    names = {inbox: [p.name for p in files] for inbox, files in waiting.items()}
    return Taken(prompts=names.get(PROMPTS, []), feedback=names.get(FEEDBACK, []))


def _movable(config: Config, inbox: Inbox) -> list[Path]:
    """The files waiting in ``inbox``, each checked to take a free name (or one holding the
    same bytes) in its data folder."""
    target = inbox.target(config)
    waiting = inbox_files(config, inbox)
    for path in waiting:
        existing = target / path.name
        if existing.exists() and not _same_bytes(path, existing):
            raise inbox.error(
                f"{path} waits to be added to {target}, but {existing} now holds other "
                "content; rename one of them"
            )
    return waiting


def _move(config: Config, inbox: Inbox, waiting: list[Path]) -> None:
    if not waiting:
        return
    target = inbox.target(config)
    target.mkdir(parents=True, exist_ok=True)
    for path in waiting:
        os.replace(path, target / path.name)
    fsync_folder(target)
    fsync_folder(inbox.folder(config))


def set_aside_rejected(
    config: Config, names: Sequence[str], reason: str, feedback: Sequence[str] = ()
) -> Path:
    """Move the raw files ``names`` and the feedback files ``feedback`` (the ones a run took
    from the inboxes, :class:`Taken`) out of ``data.raw_dir`` and ``data.feedback_dir`` into a
    new folder under ``ingest.rejected_dir`` (the feedback files into its
    :data:`FEEDBACK_ASIDE`, as a name may be in both), with ``REASON.txt`` holding ``reason``;
    returns the folder."""
    raw_dir = Path(config.data.raw_dir)
    feedback_dir = Path(config.data.feedback_dir)
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
    if feedback:
        (folder / FEEDBACK_ASIDE).mkdir()
        for name in feedback:
            with contextlib.suppress(FileNotFoundError):
                os.replace(feedback_dir / name, folder / FEEDBACK_ASIDE / name)
        fsync_folder(folder / FEEDBACK_ASIDE)
        fsync_folder(feedback_dir)
    fsync_folder(folder)
    if names:
        fsync_folder(raw_dir)
    return folder


def ingested_event(result: Ingested, project: Path) -> dict[str, Any]:
    """The keyword arguments of the event for ``result``: :data:`INGESTED_EVENT` for prompt
    files, :data:`FEEDBACK_INGESTED_EVENT` for feedback files."""
    files = [p.name for p in result.added]
    payload: dict[str, Any]
    if result.inbox == FEEDBACK:
        payload = {
            "files": files,
            "pairs": sum(result.pairs.values()),
            "ratings": sum(result.ratings.values()),
        }
    else:
        payload = {"files": files, "prompts": sum(result.prompts.values())}
    return {
        "event": result.inbox.event,
        "resource": {
            "prefect.resource.id": result.inbox.resource,
            "prefect.resource.name": str(project),
        },
        "payload": payload,
    }


def emit_ingested(result: Ingested, project: Path) -> None:
    """Send the event of ``result`` (:func:`ingested_event`) to the Prefect server
    ``PREFECT_API_URL`` names, and wait until it has been sent (a short-lived command must not
    exit with it queued).

    Raises:
        OSError (or Prefect's own error): the server cannot be reached.
    """
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    async def send() -> None:
        async with get_events_client(checkpoint_every=1) as client:
            await client.emit(Event(**ingested_event(result, project)))

    asyncio.run(send())
