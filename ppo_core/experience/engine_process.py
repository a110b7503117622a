"""The vLLM engine's process and its files (layer 3): its environment, its temporary folder, and
what is left when a stage is stopped.

A stage's timeout sends SIGTERM, whose default action ends the trainer without running
``finally`` blocks or ``atexit``: the engine's folder (the policy's fp32 weights while a load is
in flight) would stay in ``$TMPDIR`` and the worker's helper processes run on. So while an
engine is open the trainer's SIGTERM raises ``SystemExit`` (the ``with`` block closes the
engine), the worker runs in a process group of its own that closing ends whole, and each new
engine first removes the folders of engines whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

import torch

__all__ = [
    "ENGINE_FOLDER_PREFIX",
    "EngineError",
    "end_process_group",
    "engine_device_environment",
    "new_engine_folder",
    "remove_stale_engine_folders",
    "terminate_as_exit",
]

ENGINE_FOLDER_PREFIX = "ppo-vllm-"
OWNER_FILE = "owner"
UNOWNED_STALE_SECONDS = 24 * 3600.0
"""A folder of an older engine without an owner record is stale after this long."""


class EngineError(RuntimeError):
    """The rollout engine could not start, or failed or died while serving a request."""


def engine_device_environment(device: torch.device, env: dict[str, str]) -> dict[str, str]:
    """The environment that puts a rank's engine on the rank's own GPU: ``CUDA_VISIBLE_DEVICES``
    narrowed to ``device`` (counted among the GPUs ``env`` already makes visible, as torch
    counts them), so that vLLM's ``cuda:0`` is the trainer's ``device``; nothing on a CPU."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    if index >= len(visible):
        raise EngineError(
            f"generation.engine=vllm: device {device} is not among CUDA_VISIBLE_DEVICES="
            f"{env['CUDA_VISIBLE_DEVICES']!r}"
        )
    return {"CUDA_VISIBLE_DEVICES": visible[index]}


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started (psutil's create time), None when there is no such process."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def new_engine_folder(root: str | Path | None = None) -> Path:
    """A new private folder ``ppo-vllm-*`` in ``root`` (``$TMPDIR``) recording its owner (this
    process's pid and start time), after the stale folders there are removed."""
    remove_stale_engine_folders(root)
    folder = Path(tempfile.mkdtemp(prefix=ENGINE_FOLDER_PREFIX, dir=root))
    started = _process_started(os.getpid())
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {started!r}\n")
    return folder


def remove_stale_engine_folders(root: str | Path | None = None) -> list[Path]:
    """Remove the ``ppo-vllm-*`` folders of ``root`` (``$TMPDIR``) whose owner is gone: a
    process that no longer runs, or another one with its pid; a folder without an owner record
    (an older engine's) once it is a day old. Only real folders of this user are touched, never
    through a link. Returns those removed."""
    base = Path(root or tempfile.gettempdir())
    removed = []
    for folder in sorted(base.glob(f"{ENGINE_FOLDER_PREFIX}*")):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if _owner_alive(folder, info.st_mtime):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _owner_alive(folder: Path, modified: float) -> bool:
    try:
        pid_text, started_text = (folder / OWNER_FILE).read_text().split()[:2]
        pid, started = int(pid_text), float(started_text)
    except FileNotFoundError:
        return time.time() - modified < UNOWNED_STALE_SECONDS
    except (OSError, ValueError):
        return True  # unreadable: not ours to judge
    now = _process_started(pid)
    return now is not None and abs(now - started) < 1.0


@contextlib.contextmanager
def terminate_as_exit():
    """While open, SIGTERM raises ``SystemExit(143)`` in the main thread instead of ending the
    process at once, so that ``finally`` blocks and ``with`` exits run (the engine closes and
    its folder goes). Where another handler is installed, or off the main thread, nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def exit_now(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_process_group(pgid: int) -> None:
    """SIGKILL every process left in group ``pgid`` (the worker's helpers, after the worker)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
