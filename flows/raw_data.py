"""The raw prompt files and the prepared version made from them: which files ``ppo prepare``
reads and how, how a prompt is normalised and which split it falls in, and whether the raw
folder (and the feedback folder) still matches the prepared version (``ppo train`` refuses
stale data; the flow takes new files when it does not)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from ppo_core.config import Config
from ppo_core.feedback.fields import FeedbackFileError
from ppo_core.feedback.rows import feedback_sources, load_feedback_file
from ppo_core.files import entry_kind, file_sha256, printable
from ppo_core.prompts import Prompt, PromptFileError, chat_json, is_chat, load_prompts
from ppo_core.references import Reference, load_references

SUFFIXES = (".jsonl", ".parquet")
"""The files prepare reads from a raw or feedback folder."""


def _normalise(text: str) -> str:
    return " ".join(text.split())


def normalise_prompt(prompt: Prompt) -> str:
    """A prompt as a prepared split stores it: plain text with its whitespace normalised, a chat
    as the canonical JSON of its turns with each content normalised; empty when nothing is left."""
    if isinstance(prompt, str):
        return _normalise(prompt)
    turns = [{"role": turn["role"], "content": _normalise(turn["content"])} for turn in prompt]
    return chat_json(turns) if any(turn["content"] for turn in turns) else ""


def in_eval_split(prompt: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def raw_sources(raw_dir: Path) -> list[Path]:
    """The raw prompt files ``prepare`` reads, in the order it reads them: regular files, or
    links to regular files (DVC's symlink cache makes those). Any other entry with a prompt
    file's suffix (a FIFO, a device such as a link to ``/dev/zero``, a folder, a dangling
    link) is a :class:`PromptFileError` saying what it is, before anything reads it: reading
    one would block, or never end."""
    sources = sorted(p for p in raw_dir.glob("*") if p.suffix in SUFFIXES)
    for path in sources:
        kind = entry_kind(path)
        if kind is not None:
            raise PromptFileError(
                f"{printable(str(path))} is {kind}, not a prompt file; prompt files in "
                "data.raw_dir are regular files (or links to them)"
            )
    return sources


def read_raw_prompts(config: Config, path: Path) -> list[Prompt]:
    """The prompts of one raw file as ``prepare`` reads them: ``data.prompt_field``, blank
    prompts kept (``prepare`` counts and drops them), within ``data``'s size limits."""
    data = config.data
    return load_prompts(
        path,
        data.prompt_field,
        allow_empty=True,
        max_rows=data.max_rows_per_file,
        max_bytes=data.max_bytes_per_file,
    )


def read_raw_references(config: Config, path: Path) -> list[Reference]:
    """Each row's ``data.reference_fields`` of one raw file, in the order
    :func:`read_raw_prompts` gives its prompts (``[]`` when none are declared)."""
    data = config.data
    return load_references(
        path,
        data.reference_fields,
        max_rows=data.max_rows_per_file,
        max_bytes=data.max_bytes_per_file,
    )


class StaleDataError(PromptFileError):
    """The raw prompts changed since the prepared version was made."""


def raw_changes(config: Config) -> list[str]:
    """How ``data.raw_dir`` differs from the manifest of the prepared version that
    ``data.train_file`` belongs to, one entry a file (``new a.jsonl``, ``changed b.jsonl``,
    ``removed c.jsonl``; compared by name and SHA-256); every file is new when there is no
    prepared version yet, none when the raw folder does not exist."""
    data = config.data
    raw_dir = Path(data.raw_dir)
    if not raw_dir.is_dir():
        return []
    manifest_file = Path(data.train_file).parent / "manifest.json"
    return _changes(manifest_file, raw_sources(raw_dir))


# The pair version's folder beside the prepared splits: ppo_core.preference.pairs.FEEDBACK_FOLDER,
# not imported from there (it imports torch).
FEEDBACK_FOLDER = "feedback"


def feedback_changes(config: Config) -> list[str]:
    """How ``data.feedback_dir`` differs from the manifest of the pair version prepared beside
    ``data.train_file`` (``feedback/manifest.json``), as :func:`raw_changes` says it, each entry
    marked ``feedback`` (``new feedback a.jsonl``); every file is new when no pair version was
    prepared yet, none when the feedback folder does not exist."""
    data = config.data
    feedback_dir = Path(data.feedback_dir)
    if not feedback_dir.is_dir():
        return []
    manifest_file = Path(data.train_file).parent / FEEDBACK_FOLDER / "manifest.json"
    changes = _changes(manifest_file, feedback_sources(feedback_dir))
    return [change.replace(" ", " feedback ", 1) for change in changes]


def _changes(manifest_file: Path, sources: list[Path]) -> list[str]:
    """How ``sources`` differ from the sources ``manifest_file`` records (none when it does not
    exist), by name and SHA-256."""
    recorded = (
        {
            Path(source["file"]).name: source["sha256"]
            for source in json.loads(manifest_file.read_text()).get("sources", [])
        }
        if manifest_file.is_file()
        else {}
    )
    current = {path.name: file_sha256(path) for path in sources}
    changes = [f"new {name}" for name in current if name not in recorded]
    changes += [f"changed {n}" for n in current if n in recorded and current[n] != recorded[n]]
    changes += [f"removed {name}" for name in recorded if name not in current]
    return changes


def check_raw_data_is_prepared(config: Config) -> None:
    """Refuse to train when ``data.raw_dir`` no longer matches the manifest of the prepared
    version that ``data.train_file`` belongs to (:func:`raw_changes`): new prompts would be
    silently ignored.

    Nothing is checked when the train file is not part of a prepared version (a manifest beside
    it) or the raw folder does not exist, or with ``train.allow_stale_data``.
    """
    manifest_file = Path(config.data.train_file).parent / "manifest.json"
    if config.train.allow_stale_data or not manifest_file.is_file():
        return
    changes = raw_changes(config)
    if changes:
        raise StaleDataError(
            f"{config.data.raw_dir} changed since {manifest_file.parent} was prepared "
            f"({', '.join(changes)}); run `ppo prepare && ppo validate` (or `dvc repro "
            "validate`) to train on it, or pass train.allow_stale_data=true to train on the "
            "prepared version as it is"
        )


def row_kinds(config: Config, path: Path, feedback: bool) -> set[bool]:
    """Whether the rows of ``path`` are chats (True) or plain prompts (False), read as
    ``prepare`` reads a raw prompt file (a feedback file with ``feedback``)."""
    if feedback:
        data = config.data
        pairs, ratings = load_feedback_file(
            path, max_rows=data.max_rows_per_file, max_bytes=data.max_bytes_per_file
        )
        return {is_chat(row.prompt) for row in pairs} | {is_chat(row.prompt) for row in ratings}
    return {is_chat(prompt) for prompt in read_raw_prompts(config, path)}


def kinds_found(
    config: Config,
    new: dict[str, set[bool]],
    folders: Sequence[Path],
    skip: set[str],
    feedback: bool,
) -> dict[bool, str]:
    """Each kind of rows (chat: True, plain: False) and the first file that holds it: the new
    files' (``new``, by name), then, while one kind alone is found, the files of ``folders``
    but those named in ``skip``. A file there that does not read is left for ``prepare`` to
    name."""
    found: dict[bool, str] = {}
    for name, kinds in new.items():
        for kind in kinds:
            found.setdefault(kind, name)
    for folder in folders:
        if len(found) > 1 or not folder.is_dir():
            continue
        for path in sorted(folder.glob("*")):
            if path.name in skip or path.name.startswith(".") or path.suffix not in SUFFIXES:
                continue
            try:
                kinds = row_kinds(config, path, feedback)
            except (PromptFileError, FeedbackFileError, OSError):
                continue
            for kind in kinds:
                found.setdefault(kind, str(path))
    return found
