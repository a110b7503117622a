"""Models in a local Hugging Face cache, found without a network (layer 2).

The hub client (``hf download``, ``from_pretrained`` with a hub id) keeps each repository in
``<cache>/models--<org>--<name>/``: the files once each in ``blobs/`` (named by their hash),
``refs/<branch>`` holding a commit hash, and ``snapshots/<commit>/`` holding the repository's
files as symbolic links into ``blobs/``. A snapshot folder is therefore all links, which the
project otherwise refuses (a link can point at a private key or a device). Here a link is
followed only when it resolves to a regular file directly in that repository's own ``blobs/``
(:func:`snapshot_blobs`); every other link stays refused.

The cache folder is the hub client's: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. Nothing is ever
downloaded: a hub id that is not in the cache is refused with the command that fetches it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ppo_core.files import printable
from ppo_core.models.folders import ModelFolderError

__all__ = [
    "HUB_ID",
    "HubCacheError",
    "hub_cache_dir",
    "resolve_model_source",
    "snapshot_blobs",
    "snapshot_of",
]

HUB_ID = re.compile(r"(?P<org>[A-Za-z0-9][A-Za-z0-9_.-]*)/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)")
"""A hub repository id, ``org/name`` (the hub's own character rules, without ``--`` checks)."""
COMMIT = re.compile(r"[0-9a-f]{40}")


class HubCacheError(ModelFolderError):
    """A hub id is not in the local cache, or its cache entry is damaged."""


def hub_cache_dir() -> Path:
    """The hub client's cache folder, from the environment as the client reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg) / "huggingface" / "hub"


def snapshot_of(hub_id: str, key: str, revision: str = "main") -> Path:
    """The snapshot folder of ``hub_id`` at ``revision`` (a branch in ``refs/`` or a commit hash)
    in the local cache; :class:`HubCacheError` naming ``key``, the id and the cache otherwise."""
    match = HUB_ID.fullmatch(hub_id)
    if match is None or ".." in hub_id or "--" in hub_id:
        raise HubCacheError(f"{key}={printable(hub_id)!r} is not a hub id (org/name)")
    cache = hub_cache_dir()
    repo = cache / f"models--{match['org']}--{match['name']}"
    fetch = f"fetch it on a machine with access (`hf download {hub_id}`) and copy the cache"
    if not repo.is_dir():
        raise HubCacheError(
            f"{key}={hub_id!r} is neither a local path nor in the Hugging Face cache "
            f"{printable(str(cache))!r} (models are never downloaded); {fetch}, or give a folder"
        )
    commit = revision
    if not COMMIT.fullmatch(revision):
        ref = repo / "refs" / revision
        commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
        if not COMMIT.fullmatch(commit):
            raise HubCacheError(
                f"{key}={hub_id!r}: the cache {printable(str(repo))!r} has no readable "
                f"refs/{revision}; {fetch}"
            )
    snapshot = repo / "snapshots" / commit
    if snapshot.is_symlink() or not _inside(snapshot, repo):
        # a snapshot is a folder of the entry; a link could make any folder "the model"
        raise HubCacheError(
            f"{key}={hub_id!r}: {printable(str(snapshot))!r} is a link, not a folder of the "
            "cache entry; refusing it"
        )
    if not snapshot.is_dir():
        raise HubCacheError(
            f"{key}={hub_id!r}: refs/{revision} names commit {commit}, which has no snapshot in "
            f"{printable(str(repo))!r}; {fetch}"
        )
    return snapshot


def snapshot_blobs(path: str | Path) -> Path | None:
    """The ``blobs/`` folder of the cached repository whose snapshot folder is ``path`` or holds
    the file ``path`` (checked on the real path, links resolved); ``None`` when ``path`` is not
    inside a snapshot of a hub cache."""
    given = Path(path)
    # A file in a snapshot is a link into blobs/: resolve its folder, not the file itself.
    real = (
        Path(os.path.realpath(given))
        if given.is_dir()
        else Path(os.path.realpath(given.parent)) / given.name
    )
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            blobs = folder.parent.parent / "blobs"
            if blobs.is_symlink() or (blobs.exists() and not _inside(blobs, blobs.parent)):
                # links are followed into blobs/ only: a blobs/ that is itself a link would let
                # a snapshot's links reach any folder (a private key into models/base)
                raise HubCacheError(
                    f"{printable(str(blobs))!r} is a link, not a folder of its cache entry; "
                    "refusing the snapshot's links into it"
                )
            return blobs if blobs.is_dir() else None
    return None


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path``'s real path lies inside ``folder``'s real path."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real.startswith(root.rstrip(os.sep) + os.sep)


def resolve_model_source(value: str, key: str) -> Path:
    """The local path that ``value`` names: itself when it exists (a folder, a file, a link),
    else the cached snapshot of the hub id ``value`` (:func:`snapshot_of`); a value that is
    neither comes back as a path, for the folder checks to refuse by name."""
    path = Path(value)
    if path.exists() or path.is_symlink() or not HUB_ID.fullmatch(value):
        return path
    return snapshot_of(value, key)
