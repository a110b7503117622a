"""Where a production version comes from, and the bases it needs (layer 3).

Scheduled retraining chains generations: each run imports the current production version as
its base (``ppo base base.source=<production_dir>/vNNNN``), trains on it, and may promote the
result as the next version. This module keeps that chain sound (docs/design.md, "Generations"):

- **Lineage.** ``ppo base`` writes the parent version and the chain's **origin** (the whole
  model the first generation trained from) into the base's ``imported_from.json``
  (:func:`production_lineage`); evaluation measures drift from the origin
  (:func:`origin_folder`), and the registry records both with each decision.
- **Self-contained versions.** A model that a version needs and a later stage may rewrite (the
  base of a LoRA adapter version, the origin of a chain) is copied once into
  ``<production_dir>/bases/<fingerprint>`` (:func:`store_base`): content-addressed, so a base
  shared by many versions is stored once, and checked against its fingerprint whenever it is
  used again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_core.files import (
    UnsafeCopyError,
    atomic_folder,
    copy_regular_tree,
    file_sha256,
    first_line,
    regular_files,
    tree_sha256,
)
from ppo_core.files.artifacts import IMPORT_RECORD
from ppo_core.models.adapter_folders import (
    STORED_BASES,
    AdapterError,
    base_fingerprint,
    base_record_path,
    is_adapter_folder,
)
from ppo_core.models.folders import check_model_folder

__all__ = [
    "BASES_DIR",
    "Lineage",
    "LineageError",
    "origin_folder",
    "read_lineage",
    "store_base",
    "stored_base_hashes",
]

BASES_DIR = STORED_BASES
"""Folder under ``promote.production_dir`` holding the whole models versions depend on."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


class LineageError(ValueError):
    """A lineage record or a stored base is damaged, missing or changed since it was stored."""


@dataclass(frozen=True)
class Lineage:
    """A base's place in a chain of generations.

    ``parent``: the production version the base was imported from (None: the base starts a
    chain). ``origin``: ``{"path": ..., "base_sha256": ...}`` of the chain's first whole model
    as stored under :data:`BASES_DIR` (None: the base itself is the origin)."""

    parent: str | None = None
    origin: dict[str, str] | None = None

    def as_record(self) -> dict[str, Any]:
        return {"parent_version": self.parent, "origin": self.origin}


def read_lineage(base: str | Path) -> Lineage:
    """The lineage recorded in ``base``'s :data:`IMPORT_RECORD` (an empty one for a base that
    was built, or imported from outside the registry)."""
    record_file = Path(base) / IMPORT_RECORD
    if not record_file.is_file():
        return Lineage()
    try:
        record = json.loads(record_file.read_text())
    except (ValueError, OSError) as exc:
        raise LineageError(f"{record_file} is damaged ({exc}); run `ppo base` again") from None
    if not isinstance(record, dict):
        raise LineageError(f"{record_file} is damaged (not an object); run `ppo base` again")
    parent, origin = record.get("parent_version"), record.get("origin")
    if parent is not None and not isinstance(parent, str):
        raise LineageError(f"{record_file} names parent_version {parent!r}; run `ppo base` again")
    if origin is not None:
        _check_origin_record(origin, record_file)
    return Lineage(parent, origin)


def _check_origin_record(origin: object, where: object) -> None:
    ok = (
        isinstance(origin, dict)
        and isinstance(origin.get("path"), str)
        and isinstance(origin.get("base_sha256"), str)
        and _SHA256.fullmatch(origin["base_sha256"]) is not None
    )
    if not ok:
        raise LineageError(
            f"{where} names the origin {origin!r}; an origin is "
            '{"path": ..., "base_sha256": <SHA-256>}'
        )


def origin_folder(policy: str | Path) -> Path:
    """The chain's origin for a run that trains from ``policy`` (``model.policy``): the stored
    origin its lineage names, checked against its fingerprint, else ``policy`` itself."""
    origin = read_lineage(policy).origin
    if origin is None:
        return Path(policy)
    folder = Path(origin["path"])
    check_model_folder(folder, f"the origin of the chain of {str(policy)!r}")
    if base_fingerprint(folder) != origin["base_sha256"]:
        raise LineageError(
            f"the origin {str(folder)!r} that {Path(policy) / IMPORT_RECORD} names no longer "
            f"matches its fingerprint ({origin['base_sha256'][:12]}...); restore "
            "the production folder (`dvc pull`) before evaluating"
        )
    return folder


VARYING_FILES = frozenset({IMPORT_RECORD, ".ppo-output"})
"""Files of a base that differ between two imports of the same model (the import's record,
dated; the pipeline's output marker): a stored base the registry has no content hash for may
differ from the base being stored in these alone."""


def stored_base_hashes(registry: dict[str, Any]) -> dict[str, str]:
    """The content hash the registry recorded for each stored base (``adapter_base`` and
    ``origin`` records of its entries), by path."""
    hashes = {}
    for entry in registry.get("entries", []):
        for key in ("adapter_base", "origin"):
            record = entry.get(key)
            if isinstance(record, dict) and isinstance(record.get("content_sha256"), str):
                hashes[str(record.get("path"))] = record["content_sha256"]
    return hashes


def store_base(
    production_dir: str | Path, folder: str | Path, recorded: dict[str, str] | None = None
) -> dict[str, str]:
    """Copy the whole model ``folder`` to ``<production_dir>/bases/<fingerprint>`` unless a copy
    with that fingerprint is there already; returns ``{"path", "base_sha256",
    "content_sha256"}`` naming the copy, its fingerprint and the SHA-256 of all its files.

    The fingerprint (:func:`ppo_core.models.adapter_folders.base_fingerprint`: the config and
    the weights) is what an adapter checks its base against; the content hash covers every other
    file too (a ``generation_config.json`` decides where replies end). A copy already there is
    adopted only when it holds what the registry recorded for it (``recorded``:
    :func:`stored_base_hashes`), or, where the registry recorded nothing, when every file in it is
    the same as in ``folder`` (:data:`VARYING_FILES` apart); one holding other or extra files,
    or links, is refused, never adopted."""
    folder = check_model_folder(folder, "a base to store")
    if is_adapter_folder(folder):
        raise AdapterError(f"{str(folder)!r} is an adapter; only whole models are stored as bases")
    fingerprint = base_fingerprint(folder)
    target = Path(production_dir) / BASES_DIR / fingerprint
    path = base_record_path(target)
    if target.exists() or target.is_symlink():
        content = _adoptable(target, folder, (recorded or {}).get(path))
        return {"path": path, "base_sha256": fingerprint, "content_sha256": content}

    def write(tmp: Path) -> None:
        copy_regular_tree(folder, tmp)
        if base_fingerprint(tmp) != fingerprint:  # the source changed while it was copied
            raise LineageError(f"{str(folder)!r} changed while it was stored; try again")

    atomic_folder(target, write)
    return {"path": path, "base_sha256": fingerprint, "content_sha256": tree_sha256(target)}


def _adoptable(target: Path, source: Path, recorded: str | None) -> str:
    """The content hash of the stored base ``target`` when it may be used for ``source``, else
    a :class:`LineageError` naming what is wrong with it."""
    restore = "; restore the production folder (e.g. `dvc pull`) or move it aside, then promote"
    try:
        files = dict(regular_files(target)) if target.is_dir() and not target.is_symlink() else None
        content = tree_sha256(target) if files is not None else None
    except UnsafeCopyError as exc:
        raise LineageError(f"the stored base {target} holds {first_line(exc)}{restore}") from None
    if files is None or content is None:
        raise LineageError(f"the stored base {target} is not a folder{restore}")
    if base_fingerprint(target) != target.name:
        raise LineageError(f"the stored base {target} no longer matches its fingerprint{restore}")
    if recorded is not None:
        if content != recorded:
            raise LineageError(
                f"the stored base {target} no longer holds what the registry recorded for it "
                f"(content sha256 {recorded[:12]}...): a file in it was changed, added or "
                f"removed{restore}"
            )
        return content
    expected = dict(regular_files(source))
    extra = sorted(set(files) - set(expected) - VARYING_FILES)
    changed = sorted(
        name
        for name in set(files) & set(expected) - VARYING_FILES
        if file_sha256(target / name) != file_sha256(source / name)
    )
    if extra or changed:
        raise LineageError(
            f"the stored base {target}, which no registry entry recorded, holds "
            + (f"files the base {source} does not ({', '.join(extra[:5])})" if extra else "")
            + (" and " if extra and changed else "")
            + (f"files that differ from the base's ({', '.join(changed[:5])})" if changed else "")
            + f": not adopted{restore}"
        )
    return content
