"""Where a run computes (layer 3): device, data-parallel rank, autocast and CPU threads.

Training and evaluation set up the same way; only training joins a ``torchrun`` process group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ppo_core.config import Config
from ppo_core.distributed import DataParallel, init_distributed

__all__ = ["Runtime", "resolve_device", "setup_runtime"]


@dataclass(frozen=True)
class Runtime:
    """The device this process computes on, its place among data-parallel ranks, and the
    precision of forward passes. The default is one CPU process in float32."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    parallel: DataParallel = field(default_factory=DataParallel)
    precision: str = "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context for forward passes: bf16 autocast when asked for, else nothing."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device; use device=auto or cpu")
    return torch.device(name)


def setup_runtime(config: Config, distributed: bool = True) -> Runtime:
    """Set CPU threads, pick the device and, with ``distributed``, join the process group that
    ``torchrun`` describes (one process without it)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    parallel = DataParallel()
    if distributed:
        parallel, device = init_distributed(device)
    return Runtime(device=device, parallel=parallel, precision=config.precision)
