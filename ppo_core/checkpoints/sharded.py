"""Sharded checkpoints (layer 2): every rank of a sharded run writes its own shards at once.

``shards/`` is a ``torch.distributed.checkpoint`` (DCP) folder in which each rank wrote its own
shards of the weights and of the optimizer's state; ``model/`` holds the config and the
tokenizer only. DCP records where each shard lies in the whole tensor, so
:func:`load_sharded_checkpoint` reads it into any layout: sharded over another number of ranks,
or whole in one process. The folder, its checksums and its atomic rename are those of every
checkpoint (:mod:`ppo_core.checkpoints.store`).

Reading one runs no code from it: the DCP metadata is unpickled by an unpickler that builds
DCP's own metadata classes and nothing else (:func:`read_dcp_metadata`), and a shard entry that
is not a tensor is refused rather than unpickled.

This module imports DCP (about 1.6 s), so the trainer imports it only for a sharded run.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ppo_core.checkpoints.store import (
    MODEL_DIR,
    SHARDED,
    CheckpointError,
    commit_checkpoint,
    load_tensors,
    save_tensors,
    write_run_state,
)
from ppo_core.files import first_line, printable

__all__ = ["load_sharded_checkpoint", "read_dcp_metadata", "save_sharded_checkpoint"]

SHARDS_DIR = "shards"
OPTIMIZER_GROUPS_FILE = "optimizer_groups.pt"
SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def save_sharded_checkpoint(
    checkpoint_dir: str | Path,
    iteration: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    describe_model: Callable[[Path], None],
    scheduler: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path | None:
    """Write checkpoint ``step-{iteration:06d}`` from every rank at once (a collective).

    Each rank writes its own shards of ``model``'s state and of ``optimizer``'s (DCP, into
    ``shards/``); rank 0 writes the rest (``describe_model`` into ``model/``, the optimizer's
    hyperparameters, the scheduler and ``state``), checksums every file, the shards of all ranks
    included, and renames the folder into place only after every rank's shards are written.
    Returns the folder on rank 0, None on the others. The folder must be one that every rank
    sees (a shared file system, as for DCP in general)."""
    sharded = {"model": model.state_dict(), "optimizer": {"state": _optimizer_tensors(optimizer)}}
    distributed = dist.is_initialized()
    if distributed and dist.get_rank() != 0:
        shared: list[str | None] = [None]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is None:
            raise CheckpointError(
                f"rank 0 could not start checkpoint step-{iteration:06d} in {checkpoint_dir}"
            )
        dcp.save(sharded, checkpoint_id=Path(shared[0]) / SHARDS_DIR)
        return None
    told = False

    def tell(folder: str | None) -> None:
        nonlocal told
        if distributed and not told:
            told = True
            dist.broadcast_object_list([folder], src=0)

    def write(tmp: Path) -> None:
        tell(str(tmp))
        # DCP's last step gathers every rank's result on rank 0: when it returns, every shard
        # is on disk and may be checksummed
        with _quiet_in_one_process():
            dcp.save(sharded, checkpoint_id=tmp / SHARDS_DIR, no_dist=not distributed)
        describe_model(tmp / MODEL_DIR)
        save_tensors(optimizer.state_dict()["param_groups"], tmp / OPTIMIZER_GROUPS_FILE)
        write_run_state(tmp, iteration, scheduler, {**state, "checkpoint_format": SHARDED})

    try:
        return commit_checkpoint(Path(checkpoint_dir), iteration, write, keep)
    finally:
        tell(None)  # the other ranks wait for a folder name: release them if none was sent


@contextlib.contextmanager
def _quiet_in_one_process() -> Iterator[None]:
    """DCP warns when it runs in one process, which is meant here (one process resuming a sharded
    run, or writing a checkpoint in a test)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state (AdamW's moments and step, SGD's momentum), keyed by
    the parameter's index in ``state_dict()`` as text; a sharded parameter's state is sharded."""
    return {
        str(index): {name: value for name, value in entries.items() if torch.is_tensor(value)}
        for index, entries in optimizer.state_dict()["state"].items()
    }


# What DCP's ``.metadata`` pickle may build: its metadata dataclasses, tensor sizes, dtypes and
# layouts, and the checkpoint's path. Every other global (a function to call, a class with a
# __reduce__ of its own) is refused before it runs.
_DCP_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


# ASCII digits only (`\d` matches every script's): the names DCP itself writes
_SHARD_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"it names {printable(module)}.{printable(name)}, which is not part of DCP's "
            "metadata (refused, not run)"
        )


def read_dcp_metadata(path: str | Path) -> Any:
    """The ``torch.distributed.checkpoint`` ``Metadata`` pickled in ``path`` (``.metadata``),
    unpickled without running code from it: only DCP's metadata classes, tensor sizes, dtypes
    and layouts are built (where DCP's own reader calls ``pickle.load``). Every shard it points
    to must be a ``__R_N.distcp`` file beside it, stored without transforms.

    Raises:
        CheckpointError: anything else, naming the file.
    """
    path = Path(path)
    try:
        with path.open("rb") as handle:
            metadata = _DcpMetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: refused to load ({first_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: refused to load (it holds no DCP metadata)")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_FILE.fullmatch(name):
            raise CheckpointError(
                f"{path}: refused to load ({getattr(index, 'fqn', index)!r} lies in "
                f"{printable(str(name))!r}, not in a shard file beside it)"
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: refused to load ({getattr(index, 'fqn', index)!r} is stored "
                "transformed; this project writes shards as they are)"
            )
    return metadata


def _dcp_reader(shards: Path) -> Any:
    """A DCP ``FileSystemReader`` of ``shards`` that reads the metadata with
    :func:`read_dcp_metadata`, and a load planner that refuses to unpickle anything but a
    tensor (DCP's own loads a non-tensor entry with ``torch.load(weights_only=False)``)."""

    class MetadataCheckedReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError:
                files = sorted(
                    {self.storage_data[i.storage_index].relative_path for i in plan.items}
                )
                raise CheckpointError(
                    f"{shards / files[0] if len(files) == 1 else shards}: refused to load (it "
                    "holds pickled objects other than tensors; nothing in it was run)"
                ) from None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(
                shards / (".metadata" if rank is None else f"__{rank}.metadata")
            )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise CheckpointError(
                f"checkpoint shards {shards}: {read_item.dest_index.fqn!r} is not a tensor "
                "(refused, not unpickled)"
            )

    return MetadataCheckedReader(str(shards)), TensorsOnlyPlanner()


def load_sharded_checkpoint(
    folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Read a sharded checkpoint into ``model`` and ``optimizer`` as they are laid out now:
    sharded over any number of ranks, or whole (every rank calls it).

    The checkpoint's tensors are checked against the model's names and shapes first: one
    written for another model is refused with a :class:`CheckpointError` naming the folder and
    the first tensor that differs, before anything is read into the model."""
    folder = Path(folder)
    shards = folder / SHARDS_DIR
    saved = read_dcp_metadata(shards / ".metadata").state_dict_metadata
    model_state = model.state_dict()
    for name, value in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {folder} has no tensor {name}: it was written for another model"
            )
        shape = tuple(entry.size)
        if shape != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {folder} holds {name} of shape {shape}, this model's is "
                f"{tuple(value.shape)}: it was written for another model"
            )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer_state: dict[str, dict[str, torch.Tensor]] = {}
    prefix = "optimizer.state."
    for key, entry in saved.items():
        if not key.startswith(prefix) or not isinstance(entry, TensorStorageMetadata):
            continue
        index, name = key[len(prefix) :].split(".", 1)
        if not (index.isascii() and index.isdigit()) or int(index) >= len(params):
            raise CheckpointError(
                f"checkpoint {folder} holds optimizer state for parameter {index}; this model "
                f"trains {len(params)} parameters: it was written for another model"
            )
        param, size = params[int(index)], tuple(entry.size)
        # a moment has its parameter's shape and is laid out like it; a step count is a scalar
        optimizer_state.setdefault(index, {})[name] = (
            torch.zeros_like(param)
            if size == tuple(param.shape)
            else torch.zeros(size, dtype=entry.properties.dtype)
        )
    reader, planner = _dcp_reader(shards)
    try:
        with _quiet_in_one_process():
            dcp.load(
                {"model": model_state, "optimizer": {"state": optimizer_state}},
                storage_reader=reader,
                planner=planner,
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as exc:  # DCP's, a BaseException: each rank's error, wrapped
        raise _first_failure(exc, folder) from None
    model.load_state_dict(model_state)
    optimizer.load_state_dict(
        {
            "state": {int(index): entries for index, entries in optimizer_state.items()},
            "param_groups": load_tensors(folder / OPTIMIZER_GROUPS_FILE),
        }
    )


def _first_failure(exc: Any, folder: Path) -> CheckpointError:
    """The error of a failed ``dcp.load`` as one :class:`CheckpointError`: a rank's own one when
    it raised one, else the first line of the first rank's."""
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, BaseException):
            return CheckpointError(
                f"checkpoint {folder}: its shards failed to load ({first_line(error)})"
            )
    return CheckpointError(f"checkpoint {folder}: its shards failed to load")
