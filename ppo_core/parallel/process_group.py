"""Data-parallel setup for the train stage under ``torchrun`` (layer 3).

``torchrun --nproc_per_node N -m flows.cli train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous address; :func:`init_distributed` joins the process group
(gloo on CPU, NCCL on CUDA). Without those variables everything runs in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "init_distributed", "is_main_process"]


def is_main_process() -> bool:
    """Whether this process is rank 0 of a ``torchrun`` launch, or runs alone.

    Reads torchrun's ``RANK`` (absent in a plain process, which counts as rank 0), so it answers
    before the process group is joined and outside the train stage. Rank 0 alone writes the
    shared outputs: checkpoints, the model, reports and the console summary.
    """
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class DataParallel:
    """Where this process stands among the data-parallel ranks."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def most(self, count: int) -> int:
        """The largest of every rank's ``count`` (this one's alone without a process group)."""
        if not self.active:
            return count
        value = torch.tensor([count], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def rows(self, per_rank: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of the global rollout batch that this rank holds."""
        return self.rank * per_rank, (self.rank + 1) * per_rank


def init_distributed(device: torch.device) -> tuple[DataParallel, torch.device]:
    """Join the process group described by torchrun's environment, if any.

    Returns the rank information and the device this rank should use (``cuda:LOCAL_RANK`` on
    GPUs).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DataParallel(), device
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size()), device
