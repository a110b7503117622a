"""Where a run computes (layer 3): device, data-parallel rank, autocast and CPU threads.

Training and evaluation set up the same way; only training joins a ``torchrun`` process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ppo_core.config import Config
from ppo_core.parallel.process_group import DataParallel, init_distributed

__all__ = [
    "AUTO_BF16_MIN_WIDTH",
    "AUTO_BF16_SPEEDUP",
    "PrecisionChoice",
    "PrecisionWarning",
    "Runtime",
    "bf16_slowdown_message",
    "choose_precision",
    "config_folder",
    "matmul_gflops",
    "model_width",
    "resolve_device",
    "setup_runtime",
]


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``precision`` resolved to on this device, and why: the setting, the result (``fp32``
    or ``bf16``), the CPU's measured matrix-product rates (``None`` on a GPU) and the policy's
    width."""

    requested: str = "fp32"
    precision: str = "fp32"
    fp32_gflops: float | None = None
    bf16_gflops: float | None = None
    model_width: int | None = None

    def metrics(self) -> dict[str, float]:
        """``perf/bf16`` (1.0 when the run computes in bf16) and both measured rates (on a
        CPU), logged with every iteration's timings."""
        metrics = {"perf/bf16": float(self.precision == "bf16")}
        if self.fp32_gflops is not None and self.bf16_gflops is not None:
            metrics["perf/matmul_fp32_gflops"] = self.fp32_gflops
            metrics["perf/matmul_bf16_gflops"] = self.bf16_gflops
        return metrics

    def describe(self) -> str:
        """One line for a log or a bench's output."""
        rates = (
            ""
            if self.fp32_gflops is None or self.bf16_gflops is None
            else f"; matmul fp32 {self.fp32_gflops:.1f}, bf16 {self.bf16_gflops:.1f} GFLOP/s"
        )
        width = "" if self.model_width is None else f", model width {self.model_width}"
        return f"precision={self.requested} -> {self.precision}{rates}{width}"


@dataclass(frozen=True)
class Runtime:
    """The device this process computes on, its place among data-parallel ranks, and the
    precision of forward passes. The default is one CPU process in float32."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    parallel: DataParallel = field(default_factory=DataParallel)
    precision: str = "fp32"
    chosen: PrecisionChoice = field(default_factory=PrecisionChoice)

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


AUTO_BF16_SPEEDUP = 1.5
"""``precision=auto`` takes bf16 on a CPU only where bf16 products run at least this many times
the fp32 rate: measured 2.7x with AVX-512 BF16 (docs/benchmarks.md), 10x with AMX, 0.002x with
AVX2 (emulated); a margin, not 1.0, so that a CPU at par does not trade exactness for nothing."""

AUTO_BF16_MIN_WIDTH = 256
"""``precision=auto`` keeps models narrower than this (hidden size) in fp32: their products are
too small for bf16 kernels to pay for the casts, and the tiny default and every test model (32 to
128 wide) then compute the same on every machine. SmolLM2-135M is 576 wide."""


def matmul_gflops(dtype: torch.dtype, size: int = 256, repeats: int = 2) -> float:
    """This CPU's rate for one ``size``-cube matrix product in ``dtype`` (best of ``repeats``),
    in GFLOP/s, with the threads torch is set to use; measured once per process and thread
    count (a fraction of a second where bf16 is emulated)."""
    return _matmul_gflops(dtype, size, repeats, torch.get_num_threads())


@functools.cache
def _matmul_gflops(dtype: torch.dtype, size: int, repeats: int, threads: int) -> float:
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
        "and backward pass slower, not faster; use precision=fp32 (or auto) here, bf16 on a GPU "
        "or a CPU that has them"
    )


def config_folder(folder: str | Path) -> Path:
    """The folder whose ``config.json`` describes the model in ``folder``: itself, or for a LoRA
    adapter folder (no ``config.json``, an ``adapter_config.json``) the base it names. Raises
    ``OSError``, ``ValueError``, ``KeyError`` or ``TypeError`` on an unreadable adapter config."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        adapter = json.loads((folder / "adapter_config.json").read_text())
        return Path(adapter["base_model_name_or_path"])
    return folder


def model_width(folder: str | Path) -> int | None:
    """The hidden size a model folder's ``config.json`` declares (``hidden_size``, ``n_embd`` or
    ``d_model``; a LoRA adapter folder's base's), or None when there is no readable one (a
    missing folder fails later, by name)."""
    try:
        declared = json.loads((config_folder(folder) / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(declared.get(key), int):
            return declared[key]
    return None


def choose_precision(requested: str, device: torch.device, width: int | None) -> PrecisionChoice:
    """Resolve ``precision`` on ``device`` for a model ``width`` wide.

    ``fp32`` and ``bf16`` are taken as they are (bf16 on a CPU that is slower at it warns,
    :class:`PrecisionWarning`). ``auto`` is bf16 where it pays and fp32 elsewhere: on CUDA, a
    GPU with bf16 support; on a CPU, a bf16 matmul rate at least :data:`AUTO_BF16_SPEEDUP`
    times the fp32 one; either way only for models at least :data:`AUTO_BF16_MIN_WIDTH` wide."""
    fp32_rate = bf16_rate = None
    if device.type == "cpu":
        fp32_rate, bf16_rate = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    if requested == "auto":
        if device.type == "cuda":
            pays = torch.cuda.is_bf16_supported()
        else:
            pays = bf16_rate is not None and bf16_rate >= AUTO_BF16_SPEEDUP * (fp32_rate or 0.0)
        wide = width is not None and width >= AUTO_BF16_MIN_WIDTH
        precision = "bf16" if pays and wide else "fp32"
    else:
        precision = requested
    if requested == "bf16" and fp32_rate is not None and bf16_rate is not None:
        message = bf16_slowdown_message(fp32_rate, bf16_rate)
        if message is not None:
            warnings.warn(message, PrecisionWarning, stacklevel=3)
    return PrecisionChoice(requested, precision, fp32_rate, bf16_rate, width)


def setup_runtime(
    config: Config, distributed: bool = True, model_folder: str | Path | None = None
) -> Runtime:
    """Set CPU threads, pick the device and, with ``distributed``, join the process group that
    ``torchrun`` describes (one process without it); then resolve ``precision``
    (:func:`choose_precision`) for the model in ``model_folder`` (default ``model.policy``)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    parallel = DataParallel()
    if distributed:
        parallel, device = init_distributed(device)
    width = model_width(model_folder if model_folder is not None else config.model.policy)
    chosen = choose_precision(config.precision, device, width)
    # Every rank must compute in one precision (FSDP's collectives carry its dtype): bf16 only
    # where every rank's measurement chose it.
    if config.precision == "auto" and parallel.most(int(chosen.precision == "fp32")):
        chosen = dataclasses.replace(chosen, precision="fp32")
    return Runtime(device=device, parallel=parallel, precision=chosen.precision, chosen=chosen)
