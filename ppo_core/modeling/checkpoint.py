"""Atomic, resumable checkpoints (layer 2).

A checkpoint is a folder ``step-000040/`` holding the model, the optimizer and scheduler states,
``trainer_state.json`` (iteration, KL coefficient, lineage) and ``checksums.json`` (SHA-256 of
every file). It is written into a hidden temporary folder and renamed into place, so a crash
never leaves a half checkpoint. Reading one runs no code from it: tensors and optimizer states
through ``torch.load(weights_only=True)``, the DCP metadata of a sharded one through an
unpickler that builds DCP's own metadata classes and nothing else (:func:`read_dcp_metadata`).
``checksums.json`` detects damage (a truncated or changed file), not tampering: whoever can write
a checkpoint can rewrite its checksums. It comes in two formats:

- whole (:func:`save_checkpoint`, written by one process): ``model/`` is a ``save_pretrained``
  folder (safetensors, tokenizer, value head) and ``optimizer.pt`` the optimizer's
  ``state_dict()``;
- sharded (:func:`save_sharded_checkpoint`, written by every rank of a sharded run at once):
  ``shards/`` is a ``torch.distributed.checkpoint`` (DCP) folder in which each rank wrote its
  own shards of the weights and of the optimizer's state, ``model/`` holds the config and the
  tokenizer only. DCP records where each shard lies in the whole tensor, so
  :func:`load_sharded_checkpoint` reads it into any layout: sharded over another number of
  ranks, or whole in one process.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppo_core.files import atomic_folder, discard, file_sha256, first_line, is_partial, printable

__all__ = [
    "METRIC_NAME",
    "CheckpointError",
    "checked_history",
    "list_checkpoints",
    "load_checkpoint_state",
    "load_latest_good",
    "load_sharded_checkpoint",
    "remove_partial",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "verify_checksums",
]

STEP_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"
MODEL_DIR = "model"
SHARDS_DIR = "shards"
OPTIMIZER_GROUPS_FILE = "optimizer_groups.pt"
SHARDED = "sharded"
SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""``trainer_state.json``'s ``checkpoint_format`` for a sharded checkpoint (absent: whole)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged."""


METRIC_NAME = re.compile(r"[a-z][a-z0-9_]*/[a-z][a-z0-9_]*")
"""A metric name as the trainer writes it, ``group/name`` in lowercase words. Names become file
paths in the metrics logger, so a name from a checkpoint's history must be one of these."""


def checked_history(history: object, where: str) -> list[dict[str, float]]:
    """The metric history stored in a checkpoint, each row ``{"iteration": n, "group/name": x}``,
    or a :class:`CheckpointError` naming ``where`` and the first thing that is not."""
    if not isinstance(history, list):
        raise CheckpointError(f"{where}: history is not a list")
    rows = []
    for number, row in enumerate(history):
        if not isinstance(row, dict):
            raise CheckpointError(f"{where}: history row {number} is not a mapping")
        for name, value in row.items():
            if not isinstance(name, str) or not (
                name == "iteration" or METRIC_NAME.fullmatch(name)
            ):
                shown = repr(name)[:40]
                raise CheckpointError(
                    f"{where}: history row {number} has the metric name {shown}, not group/name"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CheckpointError(f"{where}: history row {number}: {name} is not a number")
        rows.append({name: float(value) for name, value in row.items()})
    return rows


def remove_partial(checkpoint_dir: str | Path) -> list[str]:
    """Remove what killed writers left in ``checkpoint_dir``: hidden temporary, replaced and
    half-deleted checkpoint folders. Call it only while holding the run lock. Returns their names.
    """
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        if is_partial(path.name, STEP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return sorted(removed)


def _write_checksums(folder: Path) -> None:
    sums = {
        str(p.relative_to(folder)): file_sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKSUM_FILE
    }
    (folder / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1))


def verify_checksums(folder: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing or changed file."""
    folder = Path(folder)
    listing = folder / CHECKSUM_FILE
    if not listing.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {CHECKSUM_FILE}; it is incomplete")
    for name, expected in json.loads(listing.read_text()).items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(
                f"checkpoint {folder}: {CHECKSUM_FILE} names a file outside it "
                f"({printable(name)!r}); it was not written by this project"
            )
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {printable(name)}")
        if file_sha256(path) != expected:
            raise CheckpointError(f"checkpoint {folder}: {name} is damaged (checksum mismatch)")


def save_checkpoint(
    checkpoint_dir: str | Path,
    iteration: int,
    save_model: Callable[[Path], None],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step-{iteration:06d}`` atomically and keep the newest ``keep``.

    ``optimizer_state`` is in ``optimizer.state_dict()``'s format, as one process holding every
    parameter would have it."""

    def write(tmp: Path) -> None:
        save_model(tmp / MODEL_DIR)
        _save_tensors(optimizer_state, tmp / "optimizer.pt")
        _write_run_state(tmp, iteration, scheduler, state)

    return _commit(Path(checkpoint_dir), iteration, write, keep)


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
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

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
        _save_tensors(optimizer.state_dict()["param_groups"], tmp / OPTIMIZER_GROUPS_FILE)
        _write_run_state(tmp, iteration, scheduler, {**state, "checkpoint_format": SHARDED})

    try:
        return _commit(Path(checkpoint_dir), iteration, write, keep)
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


def _write_run_state(tmp: Path, iteration: int, scheduler: Any, state: dict[str, Any]) -> None:
    if scheduler is not None:
        _save_tensors(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=1))
    _write_checksums(tmp)


def _commit(checkpoint_dir: Path, iteration: int, write: Callable[[Path], None], keep: int) -> Path:
    path = atomic_folder(checkpoint_dir / f"{STEP_PREFIX}{iteration:06d}", write)
    for old in list_checkpoints(checkpoint_dir)[:-keep]:
        discard(old)
    return path


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
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


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
    from torch.distributed.checkpoint.metadata import Metadata

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
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

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
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
        if not index.isdigit() or int(index) >= len(params):
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
            "param_groups": _load_tensors(folder / OPTIMIZER_GROUPS_FILE),
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


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are hidden and skipped)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted(found, key=lambda p: p.name)


def load_latest_good(
    checkpoint_dir: str | Path,
) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint that verifies, its state, and one line per damaged newer one.

    A damaged checkpoint (a truncated or changed file) is skipped, never deleted, so that it can
    be inspected; the previous good one is used instead.
    """
    problems: list[str] = []
    for folder in reversed(list_checkpoints(checkpoint_dir)):
        try:
            return folder, load_checkpoint_state(folder), problems
        except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
            problems.append(f"{folder.name}: {exc}")
    return None, None, problems


def load_checkpoint_state(folder: str | Path) -> dict[str, Any]:
    """Verify and read a checkpoint: ``state``, ``optimizer``, ``scheduler``, ``model_dir`` (a
    model folder to load, None for a sharded checkpoint) and ``sharded`` (the checkpoint's folder
    for :func:`load_sharded_checkpoint`, None for a whole one)."""
    folder = Path(folder)
    verify_checksums(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    sharded = state.get("checkpoint_format") == SHARDED
    optimizer = None if sharded else _load_tensors(folder / "optimizer.pt")
    scheduler_file = folder / "scheduler.pt"
    scheduler = _load_tensors(scheduler_file) if scheduler_file.is_file() else None
    return {
        "state": state,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "model_dir": None if sharded else folder / MODEL_DIR,
        "sharded": folder if sharded else None,
    }


def _save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, then one plain file write: a full disk or a read-only
    folder raises ``OSError`` with its errno (torch's own writer reports those as a bare
    ``RuntimeError: iostream error``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with path.open("wb") as handle:
        handle.write(buffer.getbuffer())


def _load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only; a file that asks to
    build any other object is refused (never unpickled) with a :class:`CheckpointError`."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # UnpicklingError, a truncated zip, ...
        raise CheckpointError(f"{path}: refused to load ({first_line(exc)})") from None
