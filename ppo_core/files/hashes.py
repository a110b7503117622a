"""Content hashes of files and folders (standard library only): what the registry records for
a production version and what a LoRA adapter records of the base it applies to."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ppo_core.files.copying import regular_files


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, as hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_fingerprint(folder: str | Path) -> str:
    """SHA-256 (hex) that tells model folders apart without reading their weights: the bytes of
    ``config.json`` (empty when missing), then each regular file's relative path and size, in
    order. Two copies of one folder match; a changed config or a file of another size does not.
    """
    digest = hashlib.sha256()
    config = Path(folder) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for relative, size in regular_files(folder):
        digest.update(f"\0{relative}\0{size}".encode())
    return digest.hexdigest()


def tree_sha256(folder: str | Path) -> str:
    """SHA-256 (hex) of a folder's whole content, unlike :func:`folder_fingerprint`: each regular
    file's relative path and the SHA-256 of its bytes, in :func:`regular_files` order (which
    refuses links and special files). Equal for a byte-identical copy anywhere."""
    digest = hashlib.sha256()
    for relative, _ in regular_files(folder):
        digest.update(f"{relative}\0{file_sha256(Path(folder) / relative)}\n".encode())
    return digest.hexdigest()
