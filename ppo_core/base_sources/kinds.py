"""The kinds of base source, one class each under ``@base_source("name")`` (:data:`BASE_SOURCES`):
what ``base.source`` can name, and how each becomes the ``save_pretrained`` folder a run starts
from.

A kind has two static methods: ``claims(request)``, whether it handles the request (the first
that does, in the order written here, is used), and ``build(request, target)``, which writes the
folder ``target`` atomically and returns it. An import records where the model came from in
``imported_from.json`` (:func:`_import_into`); the tiny default records its recipe in
``tiny_default.json`` instead. ``flows/base_model.py`` resolves the source, checks it is no
output of the run, adds the lineage of a production version, and calls the kind.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_core.catalog import Catalog
from ppo_core.files import (
    UnsafeCopyError,
    atomic_folder,
    copy_regular_tree,
    file_sha256,
    folder_fingerprint,
    printable,
    regular_files,
)
from ppo_core.files.artifacts import IMPORT_RECORD
from ppo_core.models.adapter_folders import (
    ADAPTER_BASE_FILE,
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    is_adapter_folder,
    recorded_fingerprint,
)

__all__ = ["BASE_SOURCES", "BaseRequest", "BaseSourceError", "base_source", "build_base"]

BASE_SOURCES: Catalog = Catalog("base-model source", Path(__file__), "base_source")
"""Each kind of ``base.source`` by its name, in the order their claims are asked."""

base_source = BASE_SOURCES.register


class BaseSourceError(ValueError):
    """``base.source`` names something its kind cannot import as asked."""


@dataclass
class BaseRequest:
    """One ``base`` stage's source and settings.

    ``value`` is ``base.source`` as written (None for the tiny default), ``source`` the path it
    resolves to (a hub id's snapshot in the local cache), ``blobs`` that snapshot's ``blobs/``
    (the one place links may point into), ``record`` what ``imported_from.json`` will say,
    filled by the caller (how the source is shown, its lineage) and by the kind.
    """

    value: str | None
    source: Path | None = None
    blobs: Path | None = None
    dtype: str = "fp32"
    trust_remote_code: bool = False
    tiny_seed: int = 0
    tiny_steps: int = 400
    num_threads: int | None = None
    record: dict[str, Any] = field(default_factory=dict)


Writer = Callable[[Path], None]


def build_base(request: BaseRequest, target: Path) -> Path:
    """Write the base model ``request`` names into ``target`` with the first kind that claims it."""
    for name in BASE_SOURCES:
        kind = BASE_SOURCES[name]
        if kind.claims(request):
            return kind.build(request, target)
    raise BaseSourceError(f"base.source={request.value!r}: no kind of base source claims it")


def _import_into(target: Path, write: Writer, record: dict[str, Any]) -> Path:
    """``write`` the folder, then record its fingerprint and the time of the import beside it."""

    def write_and_record(tmp: Path) -> None:
        write(tmp)
        record["content_sha256"] = folder_fingerprint(tmp)
        record["imported_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=1))

    return atomic_folder(target, write_and_record)


@base_source("tiny")
class TinyDefault:
    """``base.source: null``: the embedded tiny GPT-2, trained here on a synthetic review corpus
    (:mod:`ppo_core.base_sources.tiny_default`)."""

    @staticmethod
    def claims(request: BaseRequest) -> bool:
        return request.value is None

    @staticmethod
    def build(request: BaseRequest, target: Path) -> Path:
        from ppo_core.base_sources.tiny_default import build_tiny_default

        return build_tiny_default(
            target,
            seed=request.tiny_seed,
            steps=request.tiny_steps,
            num_threads=request.num_threads,
        )


@base_source("gguf")
class GGUFFile:
    """A GGUF file (or a hub snapshot's link to one in its ``blobs/``): header, architecture and
    tensor types checked, converted into a folder in ``base.dtype``
    (:mod:`ppo_core.base_sources.gguf_import`)."""

    @staticmethod
    def claims(request: BaseRequest) -> bool:
        source = request.source
        return source is not None and (
            source.is_file() or (source.is_symlink() and not source.is_dir())
        )

    @staticmethod
    def build(request: BaseRequest, target: Path) -> Path:
        from ppo_core.base_sources.gguf_import import import_gguf, read_gguf

        assert request.source is not None
        real = Path(os.path.realpath(request.source))
        blobs = request.blobs
        linked_blob = blobs is not None and real.parent == Path(os.path.realpath(blobs))
        is_link = request.source.is_symlink()
        if (is_link and not linked_blob) or not stat.S_ISREG(os.lstat(real).st_mode):
            raise UnsafeCopyError(
                f"base.source={printable(str(request.source))!r} is not a regular file (a link is "
                "followed only from a Hugging Face cache snapshot into its blobs/); give the "
                "file itself"
            )
        summary = read_gguf(real, request.value)
        request.record.update(
            format="gguf",
            gguf_sha256=file_sha256(real),
            architecture=summary.architecture,
            tensor_types=summary.tensor_types,
            parameters=summary.parameters,
            dtype=request.dtype,
        )

        def convert(tmp: Path) -> None:
            import_gguf(real, tmp, request.dtype, request.value)

        return _import_into(target, convert, request.record)


@base_source("folder")
class ModelFolder:
    """A ``save_pretrained`` folder (or a hub snapshot), copied as it is, regular files only; an
    adapter folder (a LoRA production version) becomes the whole model it stands for: its base
    with the adapter merged in, so that the next generation trains, and is judged, on exactly
    the model in production (docs/design.md, "Generations")."""

    @staticmethod
    def claims(request: BaseRequest) -> bool:
        return request.source is not None

    @staticmethod
    def build(request: BaseRequest, target: Path) -> Path:
        if request.dtype != "fp32":
            raise BaseSourceError(
                f"base.dtype={request.dtype!r} applies to GGUF imports; base.source="
                f"{request.value!r} is a model folder, copied as it is (leave base.dtype=fp32)"
            )
        return _import_into(target, _folder_writer(request), request.record)


def _folder_writer(request: BaseRequest) -> Writer:
    """Check the model folder (loads as a tokenizer and a causal LM, only regular files or links
    into ``blobs``) and return the function that copies it, or merges its adapter."""
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_causal_lm

    source, blobs, record = request.source, request.blobs, request.record
    assert source is not None
    if source.is_dir():
        # links are refused before the loaders below follow any
        regular_files(source, link_root=blobs)
    # Load both first: a folder that cannot serve as a policy is refused before anything is written.
    load_tokenizer(source, request.trust_remote_code)
    model = load_causal_lm(source, "base.source", request.trust_remote_code)
    if not is_adapter_folder(source):
        record["format"] = "folder"
        code = [] if request.trust_remote_code else sorted(p.name for p in source.glob("*.py"))
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
    record["format"] = "merged adapter"
    record["adapter_base_sha256"] = recorded_fingerprint(source)

    def write_merged(tmp: Path) -> None:
        copy_regular_tree(source, tmp, link_root=blobs)  # tokenizer, value head, records
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ADAPTER_BASE_FILE):
            (tmp / name).unlink(missing_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)

    return write_merged
