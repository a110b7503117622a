"""The ``export`` stage: a production version as one GGUF file for llama.cpp and Ollama, with a
record beside it, named in the registry. Called through :mod:`flows.stages` like every stage;
``serving/dvc.yaml`` runs it on demand."""

from __future__ import annotations

import json
from pathlib import Path

from ppo_core.config import WRITE_KEYS, Config, check_write_paths, flatten
from ppo_core.files import atomic_write_text, file_sha256
from ppo_core.models.adapter_folders import is_adapter_folder
from ppo_core.registry.versions import (
    check_version,
    promoted_entry,
    record_export,
)


def export(config: Config) -> dict:
    """Write production version ``export.version`` (default: the current one) as one GGUF file
    in ``export.dir`` (``ppo_core.models.gguf_export``), with a record beside it, and name the
    export in the version's registry entry. Returns the record.

    The version is checked against the content hash the registry recorded first; an adapter
    version is merged into its stored base. The file is ``<version>-<type>.gguf``; one that
    exists already is left alone: when it is this very export (its record names the version's
    hash and the file's SHA-256) the stage reports it, otherwise it refuses to replace it."""
    import warnings

    from ppo_core.models.causal_lm import PadTokenWarning, load_tokenizer
    from ppo_core.models.gguf_export import export_gguf
    from ppo_core.models.policy import load_causal_lm
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
        earlier = _earlier_export(target, record_file, entry)
        if earlier is not None:
            earlier["already_exported"] = True
            return earlier
        raise FileExistsError(
            f"{target} exists and is not this export of {version} (its record {record_file} "
            "does not name this version's content and the file's SHA-256); an export never "
            "replaces a file: move it away, or set export.dir to another folder"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PadTokenWarning)
        tokenizer = load_tokenizer(folder, config.model.trust_remote_code)
    model = load_causal_lm(folder, "export.version", config.model.trust_remote_code)
    base_name = Path(str(entry.get("base_model") or "model")).name
    summary = export_gguf(
        model,
        tokenizer,
        target,
        settings.type,
        name=f"{base_name} PPO {version}",
        description=f"production version {version} (content sha256 {entry['content_sha256']})",
    )
    record = {
        "version": version,
        "content_sha256": entry["content_sha256"],
        "file": target.name,
        "sha256": file_sha256(target),
        "bytes": target.stat().st_size,
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
    atomic_write_text(record_file, json.dumps(record, indent=1))
    record_export(
        rules.registry,
        version,
        {"file": str(target), "type": summary.file_type, "sha256": record["sha256"]},
    )
    return record


def _earlier_export(target: Path, record_file: Path, entry: dict) -> dict | None:
    """The record of the export already at ``target`` when it is the export of ``entry``'s
    version (same content hash, file SHA-256 as recorded); None otherwise."""
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("content_sha256") != entry.get("content_sha256"):
        return None
    if not target.is_file() or target.is_symlink() or file_sha256(target) != record.get("sha256"):
        return None
    return record
