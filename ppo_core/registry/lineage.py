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

from ppo_core.files import atomic_folder, copy_regular_tree
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
    "IMPORT_RECORD",
    "Lineage",
    "LineageError",
    "origin_folder",
    "read_lineage",
    "store_base",
]

IMPORT_RECORD = "imported_from.json"
"""What ``ppo base`` writes into the base it imports: the source, its hash, and the lineage."""

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


def store_base(production_dir: str | Path, folder: str | Path) -> dict[str, str]:
    """Copy the whole model ``folder`` to ``<production_dir>/bases/<fingerprint>`` unless a copy
    with that fingerprint is there already; returns ``{"path", "base_sha256"}`` naming the copy.

    The fingerprint (:func:`ppo_core.models.adapter_folders.base_fingerprint`: the config and
    the weights) is what an adapter checks its base against; a stored copy whose fingerprint no
    longer matches its name is refused rather than reused."""
    folder = check_model_folder(folder, "a base to store")
    if is_adapter_folder(folder):
        raise AdapterError(f"{str(folder)!r} is an adapter; only whole models are stored as bases")
    fingerprint = base_fingerprint(folder)
    target = Path(production_dir) / BASES_DIR / fingerprint
    record = {"path": base_record_path(target), "base_sha256": fingerprint}
    if target.exists():
        if base_fingerprint(target) != fingerprint:
            raise LineageError(
                f"the stored base {target} no longer matches its fingerprint; restore the "
                "production folder (e.g. `dvc pull`) before promoting"
            )
        return record

    def write(tmp: Path) -> None:
        copy_regular_tree(folder, tmp)
        if base_fingerprint(tmp) != fingerprint:  # the source changed while it was copied
            raise LineageError(f"{str(folder)!r} changed while it was stored; try again")

    atomic_folder(target, write)
    return record
