"""The ``base`` stage: the model a run starts from, imported from ``base.source`` (a model
folder, a GGUF file or a hub id in the local Hugging Face cache) or built as the tiny default,
into ``model.policy``; with its record of where it came from and, for a production version, its
lineage. Called through :mod:`flows.stages` like every stage."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from ppo_core.base_sources.hub_cache import resolve_model_source, snapshot_blobs
from ppo_core.config import WRITE_KEYS, Config, ConfigError, check_write_paths, flatten
from ppo_core.files import (
    UnsafeCopyError,
    atomic_folder,
    copy_regular_tree,
    file_sha256,
    folder_fingerprint,
    printable,
    regular_files,
)
from ppo_core.files.output_paths import inside, real_path
from ppo_core.models.adapter_folders import (
    ADAPTER_BASE_FILE,
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_base_folder,
    is_adapter_folder,
    recorded_fingerprint,
)
from ppo_core.registry.lineage import Lineage, store_base
from ppo_core.registry.versions import check_version, promoted_entry


def base(config: Config) -> Path:
    """Import ``base.source`` into ``model.policy``, or build the tiny default there.

    ``model.policy`` is checked as an output first (``check_write_paths``: inside the project or
    an allowed root, clear of the repository, the sources, the inputs and the other outputs).
    ``base.source`` is a model folder, a GGUF file, or a hub id (``org/name``) found in the local
    Hugging Face cache (``ppo_core.base_sources.hub_cache``; never downloaded). A folder import
    copies regular files only, within ``ppo_core.files.MAX_COPY_BYTES``: a link, a device or a
    FIFO in the source is refused by name before anything is loaded or written, except the
    links of a hub cache snapshot into its own ``blobs/``. A GGUF file is checked (header,
    architecture, tensor types) and converted into a ``save_pretrained`` folder in
    ``base.dtype`` (``ppo_core.base_sources.gguf_import``). ``imported_from.json`` records where the
    model came from without naming the user's folders: the source's path relative to the
    project when it lies inside it, else only its name (or the hub id), and always
    ``content_sha256`` (``ppo_core.files.folder_fingerprint``: its ``config.json`` and every
    file's name and size); a GGUF import adds the file's SHA-256 and its tensor types.
    """
    check_write_paths(flatten(config), (*WRITE_KEYS, "model.policy"))
    target = Path(config.model.policy)
    if config.base.source is None:
        from ppo_core.base_sources.tiny_default import build_tiny_default

        return build_tiny_default(
            target,
            seed=config.base.tiny_seed,
            steps=config.base.tiny_steps,
            num_threads=config.threads or None,
        )
    source = resolve_model_source(config.base.source, "base.source")
    blobs = snapshot_blobs(source)
    record = _shown_source(config.base.source, source)
    lineage = _production_lineage(config, source)
    if lineage is not None:
        record.update(lineage.as_record())
        if is_adapter_folder(source):
            # a version promoted before versions kept their base names models/base, which
            # this import replaces: keep its base where the version finds it afterwards
            store_base(config.promote.production_dir, adapter_base_folder(source))
    if source.is_file() or (source.is_symlink() and not source.is_dir()):
        write = _gguf_import(config, source, blobs, record)
    else:
        if config.base.dtype != "fp32":
            raise ConfigError(
                f"base.dtype={config.base.dtype!r} applies to GGUF imports; base.source="
                f"{config.base.source!r} is a model folder, copied as it is (leave base.dtype=fp32)"
            )
        write = _folder_import(config, source, blobs, record)

    def write_and_record(tmp: Path) -> None:
        write(tmp)
        record["content_sha256"] = folder_fingerprint(tmp)
        record["imported_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        (tmp / "imported_from.json").write_text(json.dumps(record, indent=1))

    return atomic_folder(target, write_and_record)


def _shown_source(value: str, source: Path) -> dict[str, object]:
    """How ``imported_from.json`` names the source: a hub id as given, a path inside the project
    relative to it, any other path by its last name only (no user folders in the record)."""
    if str(source) != value:
        return {"source": value, "inside_project": False}  # a hub id, resolved from the cache
    project, where = real_path("."), real_path(source)
    if where != project and inside(where, project):
        return {"source": os.path.relpath(where, project), "inside_project": True}
    return {"source": Path(where).name or where, "inside_project": False}


def _folder_import(config: Config, source: Path, blobs: Path | None, record: dict):
    """Check the model folder ``source`` (loads as a tokenizer and a causal LM, only regular
    files or links into ``blobs``) and return the function that copies it."""
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_causal_lm

    if source.is_dir():
        # links are refused before the loaders below follow any
        regular_files(source, link_root=blobs)
    # Load both first: a folder that cannot serve as a policy is refused before anything is written.
    load_tokenizer(source, config.model.trust_remote_code)
    model = load_causal_lm(source, "base.source", config.model.trust_remote_code)
    if not is_adapter_folder(source):
        record["format"] = "folder"
        code = [] if config.model.trust_remote_code else sorted(p.name for p in source.glob("*.py"))
        if code:
            # the auto_map code of a hub snapshot: never run without trust_remote_code, so
            # not copied into an output that DVC pushes and later stages read
            record["left_out"] = code
            print(f"left out {', '.join(code)}: model code runs only with trust_remote_code")

        def copy_folder(tmp: Path) -> None:
            copy_regular_tree(source, tmp, link_root=blobs)
            for name in code:
                (tmp / name).unlink()

        return copy_folder
    # An adapter (a LoRA production version) becomes the whole model it stands for: its base
    # with the adapter merged in, so that the next generation trains, and is judged, on exactly
    # the model in production (docs/design.md, "Generations").
    record["format"] = "merged adapter"
    record["adapter_base_sha256"] = recorded_fingerprint(source)

    def write_merged(tmp: Path) -> None:
        copy_regular_tree(source, tmp, link_root=blobs)  # tokenizer, value head, records
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ADAPTER_BASE_FILE):
            (tmp / name).unlink(missing_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)

    return write_merged


def _production_lineage(config: Config, source: Path) -> Lineage | None:
    """The lineage of a base imported from a version of ``promote.production_dir``: the version
    as the parent and the origin its registry entry names (None for any other source). The
    version is checked against the content hash the registry recorded for it first."""
    production = real_path(config.promote.production_dir)
    where = real_path(source)
    if os.path.dirname(where) != production:
        return None
    version = os.path.basename(where)
    entry = promoted_entry(config.promote.registry, version)
    if entry is None:
        return None
    check_version(config.promote.registry, config.promote.production_dir, version)
    origin = entry.get("origin")
    if origin is None:
        print(
            f"the registry records no origin for {version} (promoted before lineage was kept): "
            f"drift is measured from {version} on"
        )
    return Lineage(parent=version, origin=origin)


def _gguf_import(config: Config, source: Path, blobs: Path | None, record: dict):
    """Check the GGUF file ``source`` (a regular file, or a link into ``blobs``; its header,
    architecture and tensor types) and return the function that converts it."""
    from ppo_core.base_sources.gguf_import import import_gguf, read_gguf

    real = Path(os.path.realpath(source))
    linked_blob = blobs is not None and real.parent == Path(os.path.realpath(blobs))
    if (source.is_symlink() and not linked_blob) or not stat.S_ISREG(os.lstat(real).st_mode):
        raise UnsafeCopyError(
            f"base.source={printable(str(source))!r} is not a regular file (a link is followed "
            "only from a Hugging Face cache snapshot into its blobs/); give the file itself"
        )
    summary = read_gguf(real, config.base.source)
    record.update(
        format="gguf",
        gguf_sha256=file_sha256(real),
        architecture=summary.architecture,
        tensor_types=summary.tensor_types,
        parameters=summary.parameters,
        dtype=config.base.dtype,
    )
    return lambda tmp: import_gguf(real, tmp, config.base.dtype, config.base.source)
