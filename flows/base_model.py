"""The ``base`` stage: the model a run starts from, imported from ``base.source`` (a model
folder, a GGUF file or a hub id in the local Hugging Face cache) or built as the tiny default,
into ``model.policy``; with its record of where it came from and, for a production version, its
lineage. Called through :mod:`flows.stages` like every stage."""

from __future__ import annotations

import os
from pathlib import Path

from ppo_core.base_sources.hub_cache import resolve_model_source, snapshot_blobs
from ppo_core.base_sources.kinds import BaseRequest, build_base
from ppo_core.config import WRITE_KEYS, Config, check_write_paths, flatten
from ppo_core.files.output_paths import inside, real_path
from ppo_core.models.adapter_folders import adapter_base_folder, is_adapter_folder
from ppo_core.registry.lineage import Lineage, store_base
from ppo_core.registry.versions import check_version, promoted_entry


def import_base(config: Config) -> Path:
    """Import ``base.source`` into ``model.policy``, or build the tiny default there.

    ``model.policy`` is checked as an output first (``check_write_paths``: inside the project or
    an allowed root, clear of the repository, the sources, the inputs and the other outputs).
    ``base.source`` is a model folder, a GGUF file, or a hub id (``org/name``) found in the local
    Hugging Face cache (``ppo_core.base_sources.hub_cache``; never downloaded); the kinds of
    source, and how each is written, are in :mod:`ppo_core.base_sources.kinds`. A folder import
    copies regular files only, within ``ppo_core.files.MAX_COPY_BYTES``: a link, a device or a
    FIFO in the source is refused by name before anything is loaded or written, except the
    links of a hub cache snapshot into its own ``blobs/``. A GGUF file is checked (header,
    architecture, tensor types) and converted into a ``save_pretrained`` folder in
    ``base.dtype``. ``imported_from.json`` records where the model came from without naming the
    user's folders: the source's path relative to the project when it lies inside it, else only
    its name (or the hub id), and always ``content_sha256`` (``ppo_core.files.folder_fingerprint``:
    its ``config.json`` and every file's name and size); a GGUF import adds the file's SHA-256
    and its tensor types.
    """
    check_write_paths(flatten(config), (*WRITE_KEYS, "model.policy"))
    target = Path(config.model.policy)
    request = BaseRequest(
        value=config.base.source,
        dtype=config.base.dtype,
        trust_remote_code=config.model.trust_remote_code,
        tiny_seed=config.base.tiny_seed,
        tiny_steps=config.base.tiny_steps,
        num_threads=config.threads or None,
    )
    if config.base.source is not None:
        source = resolve_model_source(config.base.source, "base.source")
        request.source, request.blobs = source, snapshot_blobs(source)
        request.record = _shown_source(config.base.source, source)
        lineage = _production_lineage(config, source)
        if lineage is not None:
            request.record.update(lineage.as_record())
            if is_adapter_folder(source):
                # a version promoted before versions kept their base names models/base, which
                # this import replaces: keep its base where the version finds it afterwards
                store_base(config.promote.production_dir, adapter_base_folder(source))
    return build_base(request, target)


def _shown_source(value: str, source: Path) -> dict[str, object]:
    """How ``imported_from.json`` names the source: a hub id as given, a path inside the project
    relative to it, any other path by its last name only (no user folders in the record)."""
    if str(source) != value:
        return {"source": value, "inside_project": False}  # a hub id, resolved from the cache
    project, where = real_path("."), real_path(source)
    if where != project and inside(where, project):
        return {"source": os.path.relpath(where, project), "inside_project": True}
    return {"source": Path(where).name or where, "inside_project": False}


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
