"""The model registry (layer 3); the promotion gate that decides what it records is
:mod:`ppo_core.registry.gate`.

Promoted models are immutable versions ``<production_dir>/v0001``, ``v0002``, ...; the registry
(a JSON file, replaced atomically) records every decision with its lineage and names the current
version. A rejected or failed run never touches a version or the ``current`` pointer.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ppo_core.files import (
    UnsafeCopyError,
    atomic_write_text,
    copy_regular_tree,
    exclusive_run,
    first_line,
    mark_output,
    printable,
    tree_sha256,
)
from ppo_core.files.output_paths import real_path
from ppo_core.models.adapter_folders import (
    adapter_base_folder,
    is_adapter_folder,
    point_adapter_at,
)
from ppo_core.registry.gate import GateDecision
from ppo_core.registry.lineage import store_base, stored_base_hashes
from ppo_core.registry.staging import PROMOTING, put_in_place, recover_interrupted, stage

__all__ = [
    "StaleBaselineError",
    "check_version",
    "current_production",
    "load_registry",
    "promoted_entry",
    "record_decision",
    "record_export",
    "roll_back",
]


# ASCII digits only: `\d` also matches other scripts' digits (v٠٠٠٢), a second spelling of a
# version number and a folder name that looks like another's.
VERSION_PATTERN = re.compile(r"v[0-9]{4,}")


class RegistryError(ValueError):
    """The model registry file is unreadable or names something that is not a version."""


class StaleBaselineError(RegistryError):
    """A candidate was judged against, or trained from, a production version that is no longer
    the current one (a rollback or another promotion since)."""


def load_registry(path: str | Path) -> dict[str, Any]:
    """The registry, or an empty one when the file does not exist yet.

    The file holds ``{"current": <version or null>, "entries": [<object>, ...]}``; anything else
    (not JSON, not UTF-8, nested past the parser's limit, an entry that is not an object, a
    version name that is not ``vNNNN``) is one :class:`RegistryError`, never a reset.
    """
    path = Path(path)
    if not path.exists():
        return {"current": None, "entries": []}
    if not path.is_file():
        raise RegistryError(f"model registry {path} is not a file; restore it from git or DVC")

    def broken(why: str) -> RegistryError:
        return RegistryError(
            f"model registry {path} {why}; restore it from git or DVC before promoting"
        )

    try:
        registry = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise broken(f"is not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise broken("is not UTF-8 text") from None
    except RecursionError:
        raise broken("is nested too deeply to be a registry") from None
    if not isinstance(registry, dict) or not isinstance(registry.get("entries"), list):
        raise RegistryError(f"model registry {path} has no 'entries' list")
    for number, entry in enumerate(registry["entries"], start=1):
        if not isinstance(entry, dict):
            raise broken(f"has entry {number} that is not an object ({type(entry).__name__})")
    # Version names become folder names under promote.production_dir: only vNNNN is accepted, so
    # an edited registry cannot point a run at (or make it write to) a folder outside it.
    names = [registry.get("current")] + [e.get("version") for e in registry["entries"]]
    for name in names:
        if name is not None and not (isinstance(name, str) and VERSION_PATTERN.fullmatch(name)):
            raise RegistryError(
                f"model registry {path} names version {name!r}; versions are "
                "v0001, v0002, ...; restore the registry from git or DVC"
            )
    return registry


def current_production(registry_path: str | Path, production_dir: str | Path) -> Path | None:
    """Folder of the current production version, or None before the first promotion, checked
    as :func:`check_version` checks a version."""
    current = load_registry(registry_path).get("current")
    if not current:
        return None
    return check_version(registry_path, production_dir, current)


def promoted_entry(registry_path: str | Path, version: str) -> dict[str, Any] | None:
    """The registry entry that promoted ``version``, or None when no entry did (one that a kill
    interrupted, ``"promoting"`` or ``"abandoned"``, did not)."""
    return _promoted(load_registry(registry_path), version)


def _promoted(registry: dict[str, Any], version: str) -> dict[str, Any] | None:
    return next(
        (
            e
            for e in registry["entries"]
            if e.get("version") == version and e.get("decision") == "promoted"
        ),
        None,
    )


def check_version(registry_path: str | Path, production_dir: str | Path, version: str) -> Path:
    """The folder of production version ``version``, checked: it exists, its content is the
    SHA-256 recorded when it was promoted, and an adapter version's base is there with the
    fingerprint the adapter records. A version changed on disk since is refused
    (:class:`RegistryError`) rather than used as a baseline, a base or the next production. An
    entry without a recorded hash (absent, null, or not a SHA-256) is refused the same way: the
    check cannot be switched off by editing the registry."""
    if not VERSION_PATTERN.fullmatch(version):
        raise RegistryError(f"{version!r} is not a version name (v0001, v0002, ...)")
    folder = Path(production_dir) / version
    if not (folder / "config.json").is_file() and not is_adapter_folder(folder):
        raise FileNotFoundError(
            f"the registry names production version {version} but {folder} "
            "is missing; restore it (e.g. `dvc pull`) before going on"
        )
    entry = promoted_entry(registry_path, version)
    if entry is None:
        raise RegistryError(f"the registry {registry_path} has no production version {version}")
    recorded = entry.get("content_sha256")
    if not isinstance(recorded, str) or not re.fullmatch(r"[0-9a-f]{64}", recorded):
        raise RegistryError(
            f"production version {version} has no content hash in the registry "
            f"(content_sha256 is {recorded!r}), so {folder} cannot be checked; restore the "
            "registry (e.g. `dvc pull`) or promote a version again"
        )
    if tree_sha256(folder) != recorded:
        raise RegistryError(
            f"production version {version} in {folder} no longer matches the content hash the "
            f"registry recorded when it was promoted ({str(recorded)[:12]}...); a file in it "
            "was changed, added or removed. Restore it (e.g. `dvc pull` or "
            "`dvc checkout`) before evaluating or promoting"
        )
    if is_adapter_folder(folder):
        base = adapter_base_folder(folder)  # missing or changed: AdapterError naming it
        _check_stored_base(entry.get("adapter_base"), base, version)
    return folder


def _check_stored_base(record: object, base: Path, version: str) -> None:
    """An adapter version's stored base holds every file the registry recorded when it was
    promoted (``adapter_base.content_sha256``; a version promoted before the registry recorded
    it is checked by its fingerprint alone)."""
    recorded = record.get("content_sha256") if isinstance(record, dict) else None
    if recorded is None:
        return
    try:
        content = tree_sha256(base)
    except UnsafeCopyError as exc:
        content = f"unreadable ({first_line(exc)})"
    if content != recorded:
        raise RegistryError(
            f"the base of production version {version}, {base}, no longer holds what the "
            f"registry recorded when it was promoted (content sha256 {str(recorded)[:12]}...): "
            "a file in it was changed, added or removed (a generation_config.json decides where "
            "replies end). Restore it (e.g. `dvc pull`) before evaluating, exporting or promoting"
        )


def record_decision(
    *,
    registry_path: str | Path,
    production_dir: str | Path,
    candidate_dir: str | Path,
    decision: GateDecision,
    lineage: dict[str, Any],
    base_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Append the decision to the registry; on promotion, first copy the candidate to a new
    version folder. Returns the registry entry.

    ``lineage`` holds ``parent_version`` and ``origin`` (:class:`ppo_core.registry.lineage.Lineage`) with
    the rest of what the entry records. A promoted version is self-contained: the base of an
    adapter version, and the origin of a chain that starts here (``base_dir``, the base the
    candidate trained from), are stored under ``<production_dir>/bases/``
    (:func:`ppo_core.registry.lineage.store_base`) and the version names them there, so that no later
    ``ppo base`` can take from a version what it needs to load.

    A candidate whose parent (``lineage["parent_version"]``) or evaluation baseline
    (``lineage["baseline"]``, a version's folder) is no longer the current version is refused
    before anything is written (:func:`check_still_current`)."""
    registry_path = Path(registry_path)
    with _registry_lock(registry_path, "promotion into"):
        return _record(registry_path, production_dir, candidate_dir, decision, lineage, base_dir)


def _registry_lock(registry_path: Path, what: str):
    """The registry's run lock: two promotions or rollbacks at once would pick the same version
    number or drop each other's entry."""
    return exclusive_run(
        registry_path.with_name(f".{registry_path.name}.lock"), f"{what} {registry_path}"
    )


def version_of_folder(folder: object, production_dir: str | Path) -> str | None:
    """The production version whose folder ``folder`` is (``<production_dir>/vNNNN``, links
    resolved), or None for any other folder (a base, ``model.policy``, a stored base)."""
    if not isinstance(folder, str | Path) or "\0" in str(folder):
        return None
    path = Path(real_path(folder))
    if path.parent != Path(real_path(production_dir)):
        return None
    return path.name if VERSION_PATTERN.fullmatch(path.name) else None


def check_still_current(
    registry: dict[str, Any], lineage: dict[str, Any], production_dir: str | Path
) -> None:
    """Refuse (:class:`StaleBaselineError`) a decision about a candidate that was trained from
    (``lineage["parent_version"]``) or evaluated against (``lineage["baseline"]``, a folder) a
    production version that is no longer the current one: promoting it would silently undo a
    rollback (or replace a version the evaluation never saw), and its comparison is with a
    model that is not production."""
    current = registry.get("current")
    now = f"the current version is {current}" if current else "no version is current"
    parent = lineage.get("parent_version")
    if parent is not None and parent != current:
        again = (
            f"from {current} (a from_production run, or `ppo base base.source="
            f"{Path(production_dir) / current}`, `ppo train`, `ppo evaluate`)"
            if current
            else "from the configured base (`ppo base`, `ppo train`, `ppo evaluate`)"
        )
        raise StaleBaselineError(
            f"the candidate was trained from production version {printable(str(parent))} (its "
            f"base's parent), but {now} (a rollback or another promotion since); nothing was "
            f"recorded. Retrain {again}, then promote"
        )
    baseline = version_of_folder(lineage.get("baseline"), production_dir)
    if baseline is not None and baseline != current:
        raise StaleBaselineError(
            f"the evaluation compared the candidate with production version {baseline}, but "
            f"{now} (a rollback or another promotion since); nothing was recorded. Run `ppo "
            "evaluate` again (it compares with the current version), then promote"
        )


def _record(
    registry_path: Path,
    production_dir: str | Path,
    candidate_dir: str | Path,
    decision: GateDecision,
    lineage: dict[str, Any],
    base_dir: str | Path | None,
) -> dict[str, Any]:
    registry = load_registry(registry_path)
    if recover_interrupted(production_dir, registry, "v"):
        _write_registry(registry_path, registry)
    # under the registry's lock, so that no rollback lands between this check and the write
    check_still_current(registry, lineage, production_dir)
    entry: dict[str, Any] = {
        "decision": "promoted" if decision.promote else "rejected",
        "reasons": decision.reasons,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "candidate": str(candidate_dir),
        **lineage,
    }
    if not decision.promote:
        registry["entries"].append(entry)
        _write_registry(registry_path, registry)
        return entry
    # numbered past every version ever recorded: an abandoned number that something still
    # lies under stays taken (ppo_core.registry.staging)
    numbers = [int(e["version"][1:]) for e in registry["entries"] if e.get("version")]
    version = f"v{max(numbers, default=0) + 1:04d}"
    target = Path(production_dir) / version
    if target.exists() or target.is_symlink():
        raise FileExistsError(
            f"{target} exists but the registry does not know it; refusing "
            "to overwrite a production version (move it aside)"
        )
    stored_base = None
    recorded = stored_base_hashes(registry)
    if is_adapter_folder(candidate_dir):  # the adapter's base, checked, kept with it
        stored_base = store_base(production_dir, adapter_base_folder(candidate_dir), recorded)
        entry["adapter_base"] = stored_base
    if entry.get("origin") is None and base_dir is not None:
        entry["origin"] = store_base(production_dir, base_dir, recorded)
    staging, content_sha256 = stage(
        production_dir, version, lambda folder: _write_version(candidate_dir, folder, stored_base)
    )
    # hashed before it is in place: a kill from here on is finished or undone by the next write
    entry.update(version=version, path=str(target), content_sha256=content_sha256)
    entry["decision"] = PROMOTING
    registry["entries"].append(entry)
    _write_registry(registry_path, registry)
    put_in_place(staging, target)
    entry["decision"] = "promoted"
    registry["current"] = version
    _write_registry(registry_path, registry)
    return entry


def _write_registry(registry_path: Path, registry: dict[str, Any]) -> None:
    atomic_write_text(registry_path, json.dumps(registry, indent=1))


def _write_version(candidate_dir: str | Path, folder: Path, stored_base: dict | None) -> None:
    """The candidate's files in ``folder``; an adapter is pointed at its stored base."""
    # Regular files only, within a size cap: a link in the candidate (to a private key, to
    # /dev/zero) is refused by name instead of copied into production and pushed by DVC.
    copy_regular_tree(candidate_dir, folder)
    if stored_base is not None:
        point_adapter_at(folder, stored_base["path"], stored_base["base_sha256"])
    mark_output(folder)  # a folder the pipeline wrote (ppo_core.files.atomic)


def record_export(registry_path: str | Path, version: str, export: dict[str, Any]) -> None:
    """Name an export of ``version`` (``{"file", "type", "sha256", ...}``) in the list
    ``exports`` of the registry entry that promoted it; an export of the same file replaces
    its earlier record."""
    registry_path = Path(registry_path)
    with _registry_lock(registry_path, "export record in"):
        registry = load_registry(registry_path)
        entry = _promoted(registry, version)
        if entry is None:
            raise RegistryError(f"the registry {registry_path} has no production version {version}")
        kept = [e for e in entry.get("exports") or [] if e.get("file") != export["file"]]
        entry["exports"] = [*kept, export]
        atomic_write_text(registry_path, json.dumps(registry, indent=1))


def roll_back(
    *,
    registry_path: str | Path,
    production_dir: str | Path,
    version: str,
    reason: str,
    by: str,
) -> dict[str, Any]:
    """Make the earlier production version ``version`` current again and record who did it,
    when and why (an entry ``{"decision": "rolled back", "rolled_back_to": ..., "previous":
    ..., "reason": ..., "by": ..., "date": ...}``). The version is checked first as
    :func:`check_version` checks it (its content hash, an adapter's stored base); a version the
    registry never promoted is refused naming the versions it has. Nothing is copied or
    removed, so a later promotion or rollback can return to any version."""
    registry_path = Path(registry_path)
    if not reason.strip():
        raise RegistryError("a rollback needs a reason (--reason): the registry records it")
    with _registry_lock(registry_path, "rollback in"):
        registry = load_registry(registry_path)
        if recover_interrupted(production_dir, registry, "v"):
            _write_registry(registry_path, registry)
        if not VERSION_PATTERN.fullmatch(version):
            raise RegistryError(f"{version!r} is not a version name (v0001, v0002, ...)")
        versions = [
            e["version"]
            for e in registry["entries"]
            if e.get("version") and e.get("decision") == "promoted"
        ]
        if version not in versions:
            raise RegistryError(
                f"the registry {registry_path} has no production version {version}; "
                + (
                    f"its versions are {', '.join(versions)} (current: {registry.get('current')})"
                    if versions
                    else "it has none yet (a promotion makes v0001)"
                )
            )
        check_version(registry_path, production_dir, version)
        previous = registry.get("current")
        if previous == version:
            raise RegistryError(f"{version} is already the current production version")
        entry = {
            "decision": "rolled back",
            "rolled_back_to": version,
            "previous": previous,
            "reason": reason,
            "by": by,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        registry["current"] = version
        registry["entries"].append(entry)
        _write_registry(registry_path, registry)
    return entry
