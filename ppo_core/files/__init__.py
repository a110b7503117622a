"""File safety beneath the model I/O and composition layers and the flows (standard library
only; the math layer, which imports torch alone, does not use it): atomic files and folders
(:mod:`.atomic`), safe copies of model folders (:mod:`.copying`), content hashes
(:mod:`.hashes`), run locks (:mod:`.locks`) and where outputs may go (:mod:`.output_paths`).
The names below are the ones the layers above import."""

from ppo_core.files.atomic import (
    OUTPUT_MARKER,
    ForeignFileError,
    ForeignFolderError,
    atomic_folder,
    atomic_write_bytes,
    atomic_write_text,
    check_replaceable,
    check_replaceable_file,
    clear_output_folder,
    create_sibling,
    discard,
    first_line,
    fsync_folder,
    fsync_tree,
    is_partial,
    mark_output,
    printable,
    remove_links,
)
from ppo_core.files.copying import (
    MAX_COPY_BYTES,
    UnsafeCopyError,
    copy_regular_file,
    copy_regular_tree,
    entry_kind,
    regular_files,
)
from ppo_core.files.hashes import file_sha256, folder_fingerprint, tree_sha256
from ppo_core.files.locks import RunLockedError, exclusive_run

__all__ = [
    "MAX_COPY_BYTES",
    "OUTPUT_MARKER",
    "ForeignFileError",
    "ForeignFolderError",
    "RunLockedError",
    "UnsafeCopyError",
    "atomic_folder",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_replaceable",
    "check_replaceable_file",
    "clear_output_folder",
    "copy_regular_file",
    "copy_regular_tree",
    "create_sibling",
    "discard",
    "entry_kind",
    "exclusive_run",
    "file_sha256",
    "first_line",
    "folder_fingerprint",
    "fsync_folder",
    "fsync_tree",
    "is_partial",
    "mark_output",
    "printable",
    "regular_files",
    "remove_links",
    "tree_sha256",
]
