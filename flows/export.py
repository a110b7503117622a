"""The ``export`` stage: a production version as one GGUF file for llama.cpp and Ollama, with a
record beside it, named in the registry. Called through :mod:`flows.stages` like every stage;
``serving/dvc.yaml`` runs it on demand."""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

from ppo_core.config import WRITE_KEYS, Config, check_write_paths, flatten
from ppo_core.files import atomic_write_text, exclusive_run, file_sha256, fsync_folder
from ppo_core.models.adapter_folders import is_adapter_folder
from ppo_core.registry.versions import (
    check_version,
    promoted_entry,
    record_export,
)


def export_version(config: Config) -> dict:
    """Write production version ``export.version`` (default: the current one) as one GGUF file
    in ``export.dir`` (``ppo_core.models.gguf_export``), with a record beside it, and name the
    export in the version's registry entry. Returns the record.

    The version is checked against the content hash the registry recorded first; an adapter
    version is merged into its stored base. The file is ``<version>-<type>.gguf``; one that
    exists already is left alone: when it is this very export (its SHA-256 is the one the
    registry recorded for this file in the version's ``exports``, and the record beside it
    agrees) the stage reports it, otherwise it refuses to replace it. The record beside the
    file is never trusted alone: whoever can swap the file can rewrite it too."""
    from ppo_core.registry.versions import RegistryError, load_registry

    check_write_paths(flatten(config), WRITE_KEYS)
    rules, settings = config.promote, config.export
    version = settings.version or load_registry(rules.registry).get("current")
    if version is None:
        raise RegistryError(
            f"nothing to export: the registry {rules.registry} names no production version yet "
            "(promote one first, or set export.version)"
        )
    folder = check_version(rules.registry, rules.production_dir, version)
    entry = promoted_entry(rules.registry, version) or {}
    target = Path(settings.dir) / f"{version}-{settings.type}.gguf"
    record_file = target.with_suffix(".json")
    if target.exists() or target.is_symlink():
        earlier = _earlier_export(target, record_file, version, entry, rules.registry)
        earlier["already_exported"] = True
        return earlier
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_run(target.with_name(f".{target.name}.lock"), f"the export to {target}"):
        if target.exists() or target.is_symlink():  # another export finished meanwhile
            earlier = _earlier_export(target, record_file, version, entry, rules.registry)
            return {**earlier, "already_exported": True}
        return _write_export(config, folder, version, entry, target)


def _write_export(config: Config, folder: Path, version: str, entry: dict, target: Path) -> dict:
    """Write the GGUF under a hidden staging name, hash it, write the record beside it and name
    it in the registry, and only then rename it to ``target``: a kill before the rename leaves
    no ``target`` (the next export writes it again, over the leftovers), a kill after it leaves
    a complete, recorded export."""
    import warnings

    from ppo_core.models.causal_lm import PadTokenWarning, load_tokenizer
    from ppo_core.models.gguf_export import export_gguf
    from ppo_core.models.policy import load_causal_lm

    staging = target.with_name(f".{target.name}.staging")
    # a killed export's staging file and the writer's partial siblings of it (no export of
    # this file runs now: the lock is held)
    for pattern in (staging.name, f".{staging.name}.tmp-*"):
        for leftover in target.parent.glob(glob.escape(pattern).replace(r"[*]", "*")):
            if leftover.is_file() or leftover.is_symlink():
                leftover.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PadTokenWarning)
        tokenizer = load_tokenizer(folder, config.model.trust_remote_code)
    model = load_causal_lm(folder, "export.version", config.model.trust_remote_code)
    base_name = Path(str(entry.get("base_model") or "model")).name
    summary = export_gguf(
        model,
        tokenizer,
        staging,
        config.export.type,
        name=f"{base_name} PPO {version}",
        description=f"production version {version} (content sha256 {entry['content_sha256']})",
    )
    record = {
        "version": version,
        "content_sha256": entry["content_sha256"],
        "file": target.name,
        "sha256": file_sha256(staging),
        "bytes": staging.stat().st_size,
        "type": summary.file_type,
        "architecture": summary.architecture,
        "model_type": summary.model_type,
        "adapter_merged": is_adapter_folder(folder),
        "parameters": summary.parameters,
        "tensor_types": summary.tensor_types,
        "tokenizer": summary.tokenizer,
        "notes": summary.notes,
        "origin": entry.get("origin"),
        "parent_version": entry.get("parent_version"),
    }
    atomic_write_text(target.with_suffix(".json"), json.dumps(record, indent=1))
    record_export(
        config.promote.registry,
        version,
        {"file": str(target), "type": summary.file_type, "sha256": record["sha256"]},
    )
    os.rename(staging, target)
    fsync_folder(target.parent)
    return record


def _earlier_export(
    target: Path, record_file: Path, version: str, entry: dict, registry: str | Path
) -> dict:
    """The record of the export already at ``target`` when it is the export of ``version``
    the registry recorded: ``target`` a regular file whose SHA-256 is the one in ``entry``'s
    ``exports`` for that file, and the record beside it naming the version, its content hash
    and that SHA-256. Anything else is refused (:class:`FileExistsError`, one line naming the
    file); the file is never replaced."""
    refuse = "; an export never replaces a file: move it away, or set export.dir to another folder"
    recorded = next(
        (
            e.get("sha256")
            for e in reversed(entry.get("exports") or [])
            if isinstance(e, dict)
            and isinstance(e.get("file"), str)
            and os.path.abspath(e["file"]) == os.path.abspath(target)
        ),
        None,
    )
    if not isinstance(recorded, str) or not re.fullmatch(r"[0-9a-f]{64}", recorded):
        raise FileExistsError(
            f"{target} exists and is not this export of {version}: the registry {registry} "
            f"records no export of {version} at that path (an export puts its file in place only "
            f"after the registry recorded it){refuse}"
        )
    if not target.is_file() or target.is_symlink():
        raise FileExistsError(
            f"{target} exists and is not this export of {version}: it is not a regular file{refuse}"
        )
    actual = file_sha256(target)
    if actual != recorded:
        raise FileExistsError(
            f"{target} exists and is not this export of {version}: its SHA-256 {actual} is not "
            f"the {recorded} the registry {registry} recorded for it (changed since it was "
            f"exported){refuse}"
        )
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        record = None
    if (
        not isinstance(record, dict)
        or record.get("version") != version
        or record.get("content_sha256") != entry.get("content_sha256")
        or record.get("sha256") != recorded
    ):
        raise FileExistsError(
            f"{target} is the export of {version} the registry recorded, but the record beside "
            f"it, {record_file}, is missing or does not name {version}, its content hash and "
            f"the file's SHA-256{refuse}"
        )
    return record
