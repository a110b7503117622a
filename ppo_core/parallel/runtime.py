"""Where a run computes (layer 3): device, data-parallel rank, autocast and CPU threads.

Training and evaluation set up the same way; only training joins a ``torchrun`` process group.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch

from ppo_core.config import Config
from ppo_core.parallel.process_group import DataParallel, init_distributed

__all__ = [
    "PrecisionWarning",
    "Runtime",
    "bf16_slowdown_message",
    "matmul_gflops",
    "resolve_device",
    "setup_runtime",
]


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


class PrecisionWarning(UserWarning):
    """``precision=bf16`` on a CPU that multiplies bf16 matrices slower than fp32 ones."""


def matmul_gflops(dtype: torch.dtype, size: int = 256, repeats: int = 3) -> float:
    """This CPU's rate for one ``size``-cube matrix product in ``dtype`` (best of ``repeats``),
    in GFLOP/s, with the threads torch is set to use."""
    a = torch.ones(size, size, dtype=dtype)
    b = torch.ones(size, size, dtype=dtype)
    torch.mm(a, b)  # the first call sets kernels up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / max(best, 1e-9) / 1e9


def bf16_slowdown_message(fp32_gflops: float, bf16_gflops: float) -> str | None:
    """Why ``precision=bf16`` would slow this CPU down, or None when bf16 is not slower.

    CPUs without bf16 instructions (AVX-512 BF16 or AMX; most AVX2 machines, AMD EPYC and Intel
    alike) emulate bf16 matrix products: measured here, 0.9 GFLOP/s against 52 for fp32, and a
    PPO update 18x slower than in fp32 (docs/benchmarks.md)."""
    if bf16_gflops >= fp32_gflops:
        return None
    return (
        f"precision=bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}) multiplies "
        f"bf16 matrices at {bf16_gflops:.1f} GFLOP/s against {fp32_gflops:.1f} for fp32: it "
        "has no bf16 instructions (AVX-512 BF16 or AMX), so bf16 autocast makes every forward "
        "and backward pass slower, not faster; use precision=fp32 here, bf16 on a GPU or a CPU "
        "that has them"
    )


def setup_runtime(config: Config, distributed: bool = True) -> Runtime:
    """Set CPU threads, pick the device and, with ``distributed``, join the process group that
    ``torchrun`` describes (one process without it). ``precision=bf16`` on the CPU measures
    bf16 against fp32 matrix products first and warns (:class:`PrecisionWarning`) when bf16 is
    the slower one."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    parallel = DataParallel()
    if distributed:
        parallel, device = init_distributed(device)
    if config.precision == "bf16" and device.type == "cpu":
        message = bf16_slowdown_message(matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16))
        if message is not None:
            warnings.warn(message, PrecisionWarning, stacklevel=2)
    return Runtime(device=device, parallel=parallel, precision=config.precision)
