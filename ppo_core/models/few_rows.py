"""Few-row matrix products in the layout this machine's BLAS runs fastest (layer 2), for the
sampling loop when ``generation.few_row_layouts`` is on.

Each step of the sampling loop multiplies a handful of rows (the rows still running, 1 to 64)
by every weight matrix. ``F.linear(x, W)`` computes ``x @ W.T``; some BLAS builds run the same
product written ``(W @ x.T).T`` several times faster at these shapes (measured on an AMD EPYC's
MKL with 2 threads: the SmolLM2 output layer, ``[8, 576] x [576, 49152]``, 48 against 29 ms;
docs/benchmarks.md), others not. Neither layout is right everywhere, so each shape is measured:
the first time a ``(in, out, rows, dtype)`` is met, both layouts are timed (rows rounded up to a
power of two) and the transposed one is kept only when it is at least :data:`MARGIN` times
faster. They are timed as the loop meets them: every call on a weight read from memory, not
from the cache (a model's weights outgrow the last-level cache, and a step reads each once).
The table is kept per process and in a file per CPU, torch build and thread count
(:func:`table_path`), so that runs on one machine take the same layouts and sample the same
tokens for a seed.

Exactness: the two layouts sum the same products in another order, a float rounding difference
(measured: at most 6.6e-7 of the largest output in fp32 at 4 to 64 rows, 1.1e-5 in a
sampled token's log-probability; tests/models/test_few_rows.py). Only linear layers at
least :data:`MIN_WIDTH` wide are touched, so the tiny default and the test models compute as
before on every machine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_core.files.atomic import atomic_write_text

__all__ = ["FEW_ROWS", "MARGIN", "MIN_WIDTH", "cold_bytes", "few_row_products", "table_path"]

FEW_ROWS = 64
"""Products of at most this many rows are measured; more rows keep ``F.linear``."""

MIN_WIDTH = 256
"""Linear layers narrower than this (input features) keep ``F.linear``."""

MARGIN = 1.1
"""The transposed layout must be this many times faster to be taken (timing noise must not
flip a shape's layout between runs)."""

_TABLE: dict[str, bool] = {}
_LOADED: set[Path] = set()


def table_path() -> Path:
    """Where this machine's layouts are kept: one file per CPU capability, torch version and
    thread count, under ``$XDG_CACHE_HOME/ppo-core`` (``~/.cache/ppo-core``)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ppo-core"
    capability = torch.backends.cpu.get_cpu_capability()
    version = torch.__version__.replace("+", "_")
    threads = torch.get_num_threads()
    # v2: timed on weights read from memory (v1's tables, timed on cached weights, are not read)
    return root / f"few_row_layouts-v2-{capability}-{version}-{threads}t.json"


@contextlib.contextmanager
def few_row_products(model: nn.Module) -> Iterator[None]:
    """Within the block, every CPU ``nn.Linear`` of ``model`` at least :data:`MIN_WIDTH` wide
    multiplies few-row inputs in the layout measured fastest for its shape; all others, and
    every input of more than :data:`FEW_ROWS` rows, as before."""
    patched = [
        module
        for module in model.modules()
        if isinstance(module, nn.Linear)
        and module.in_features >= MIN_WIDTH
        and module.weight.device.type == "cpu"
        and not hasattr(module.weight, "device_mesh")  # a sharded (FSDP) weight keeps its path
        and "forward" not in vars(module)
    ]
    if not patched:
        yield
        return
    path = table_path()
    _load(path)
    known = len(_TABLE)
    for module in patched:
        module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in patched:
            del module.forward
        if len(_TABLE) > known:  # written only when a shape was measured, not every call
            _save(path)


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // self.in_features
    if rows > FEW_ROWS or rows < 2:
        return F.linear(x, self.weight, self.bias)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    if not _transposed_is_faster(self.in_features, self.out_features, rows, dtype):
        return F.linear(x, self.weight, self.bias)
    out = _transposed_product(self.weight, x.reshape(rows, self.in_features))
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], self.out_features)


def _transposed_product(weight: Tensor, rows: Tensor) -> Tensor:
    """``rows @ weight.T`` (``[n, in] x [out, in] -> [n, out]``) as ``(weight @ rows.T).T``,
    copied back to row-major: left as the transposed view, every operation after the layer
    (norms, activations, the next layer's product) ran on strided memory, and the loop gained
    nothing (1.00x at 16 rows against 1.31x with the copy; docs/benchmarks.md)."""
    return torch.mm(weight, rows.t()).t().contiguous()


def _transposed_is_faster(inputs: int, outputs: int, rows: int, dtype: torch.dtype) -> bool:
    bucket = 1 << (rows - 1).bit_length()  # rows rounded up to a power of two
    threads = torch.get_num_threads()
    key = f"{inputs}x{outputs}x{bucket}:{str(dtype).removeprefix('torch.')}:{threads}t"
    if key not in _TABLE:
        _TABLE[key] = _measure(inputs, outputs, bucket, dtype)
    return _TABLE[key]


@torch.no_grad()
def _measure(inputs: int, outputs: int, rows: int, dtype: torch.dtype, repeats: int = 3) -> bool:
    """Whether ``(W @ x.T).T`` beats ``F.linear`` by :data:`MARGIN` at this shape. Each layout
    multiplies the rows by every one of as many copies of the weight as fill :func:`cold_bytes`
    (so that each call reads its weight from memory, as a step of the loop does); the best of
    ``repeats`` such sweeps, the layouts alternated after one sweep each."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
    copies = max(1, cold_bytes() // (weight.numel() * weight.element_size()))
    weights = [weight.clone() for _ in range(copies)]
    x = torch.randn(rows, inputs, generator=generator).to(dtype)

    def linear() -> None:
        for each in weights:
            F.linear(x, each)

    def transposed() -> None:
        for each in weights:
            _transposed_product(each, x)

    with torch.autocast("cpu", enabled=False):
        best = [float("inf"), float("inf")]
        for layout in (linear, transposed):
            layout()
        for _ in range(repeats):
            for index, layout in enumerate((linear, transposed)):
                started = time.perf_counter()
                layout()
                best[index] = min(best[index], time.perf_counter() - started)
    return best[0] >= MARGIN * best[1]


@functools.cache
def cold_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of weight copies a measurement sweeps: twice the largest CPU cache Linux reports
    under ``caches`` (``index*/size``, such as ``32768K``), and at least 64 MiB, so that no copy
    is still cached when it is read again."""
    largest = 0
    for entry in caches.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = entry.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            largest = max(largest, int(text.rstrip("KMG")) * scale)
    return max(2 * largest, 64 << 20)


MAX_TABLE_BYTES = 1 << 20
"""Largest layout table read (a real one is a few kB)."""


def _load(path: Path) -> None:
    if path in _LOADED:
        return
    _LOADED.add(path)
    text = _read_table(path)
    try:
        stored = json.loads(text) if text is not None else None
    except ValueError:
        return
    if isinstance(stored, dict):
        _TABLE.update({k: v for k, v in stored.items() if isinstance(v, bool) and k not in _TABLE})


def _read_table(path: Path) -> str | None:
    """The table's text when ``path`` is a regular file of at most :data:`MAX_TABLE_BYTES`;
    None for anything else (missing, a link, a FIFO that would block a reader for ever, a
    device, a huge file): the layouts are then measured again."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TABLE_BYTES:
            return None
        data = os.read(fd, MAX_TABLE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8") if len(data) <= MAX_TABLE_BYTES else None
    except UnicodeDecodeError:
        return None


def _save(path: Path) -> None:
    """Write the table atomically through ``files/`` (a unique new sibling renamed over it: a
    reader never sees half a file, and no link planted beside it is written through); a folder
    that cannot be written is no error: the table stays in this process."""
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(dict(sorted(_TABLE.items())), indent=1))
