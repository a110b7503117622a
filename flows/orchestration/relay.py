"""A stage's output as log records: its lines as they are printed, progress bars now and then,
DVC's advice once, warnings on one line; and the stage's process tree stopped on a deadline.

The Prefect flow in :mod:`flows.pipeline` sends each stage to its DVC process
(:mod:`flows.orchestration.dvc_session`), whose output a :class:`StageRelay` turns into the task's log.
"""

from __future__ import annotations

import codecs
import contextlib
import linecache
import logging
import os
import re
import select
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

# A progress bar redrawn in place (tqdm, rich) is logged at most this often while it runs, so a
# long one shows that it moves and a short one (loading weights) adds no line at INFO.
PROGRESS_EVERY_S = 10.0
# How often a silent stage's output pipe is checked for having been given up.
POLL_S = 0.5
# Lines of a failed stage's output quoted in its error.
TAIL_LINES = 15
# Python's default warning format: `path:line: Category: message`, then the source line.
WARNING_LINE = re.compile(
    r"(?P<path>\S.*?\.py):(?P<line>\d+): (?P<category>\w+Warning): (?P<text>.*)"
)
# DVC's advice after each stage that changed dvc.lock; said once, at the end of the run, instead.
DVC_TRACK_HINT = "To track the changes with git, run:"
DVC_HINT_LINES = {
    "To enable auto staging, run:",
    "dvc config core.autostage true",
    "Use `dvc push` to send your updates to remote storage.",
}


def stage_environment() -> dict[str, str]:
    """PATH with this interpreter's bin folder first, so `dvc` and `ppo` are the project's;
    unbuffered Python output, so that a stage's lines reach the log as they are printed."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # Rich wraps its output at 80 columns when it does not write to a terminal, which would cut
    # one message into two log records; the log has no width of its own.
    env["COLUMNS"] = "200"
    return env


def output_segments(
    stream: IO[bytes], give_up: Callable[[], bool] = lambda: False
) -> Iterator[tuple[str, bool]]:
    """The text of ``stream`` as it arrives, cut at line ends and carriage returns:
    ``(text, True)`` for a finished line, ``(text, False)`` for what a progress bar then draws
    over (the text before a lone ``\\r``).

    The stream ends at its end of file, or once ``give_up()`` is true while nothing arrives
    (checked every :data:`POLL_S` seconds): a process that escaped being stopped may hold the
    pipe open for ever.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        ready, _, _ = select.select([stream.fileno()], [], [], POLL_S)
        if not ready and not give_up():
            continue
        # What the pipe holds now, not a full buffer: a line is logged when it is printed.
        chunk = os.read(stream.fileno(), 65536) if ready else b""
        pending += decoder.decode(chunk, final=not chunk)
        while True:
            cut = min((i for i in (pending.find("\r"), pending.find("\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            if pending[cut] == "\n":
                yield pending[:cut], True
                pending = pending[cut + 1 :]
            elif cut + 1 < len(pending):
                crlf = pending[cut + 1] == "\n"
                yield pending[:cut], crlf
                pending = pending[cut + 2 if crlf else cut + 1 :]
            elif chunk:
                break  # a `\r` at the end of the data read so far: the next byte says which
            else:
                yield pending[:cut], True
                pending = ""
        if not chunk:
            if pending:
                yield pending, True
            return


class StageRelay:
    """Turns the output of one stage into log records, as a reader of the log wants it.

    A line redrawn in place (a progress bar) is logged every ``progress_every`` seconds while it
    lasts and its final state at INFO only when it lasted that long (at DEBUG otherwise). DVC's
    advice to `git add` is kept back (:attr:`to_track` names the files) to be said once per run.
    A Python warning is logged at WARNING without the source line that Python prints under it,
    which reads like a traceback. Blank lines are dropped; the rest is logged at INFO and the
    last :data:`TAIL_LINES` are kept for the error of a failed stage.
    """

    def __init__(
        self,
        stage: str,
        log: Callable[[int, str], None],
        repo_dir: str | Path = ".",
        progress_every: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stage = stage
        self.log = log
        self.repo_dir = Path(repo_dir).resolve()
        self.progress_every = progress_every
        self.clock = clock
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.to_track: list[str] = []
        self.skipped = False
        self._bar_since: float | None = None  # when the current line was first drawn over
        self._bar_shown = False
        self._in_track_hint = False
        self._warning_source: str | None = None

    def feed(self, text: str, finished: bool) -> None:
        text = text.rstrip()
        if not finished:
            now = self.clock()
            if self._bar_since is None:
                self._bar_since = now
            elif text and now - self._bar_since >= self.progress_every:
                self.log(logging.INFO, text)
                self._bar_since, self._bar_shown = now, True
            return
        redrawn, shown = self._bar_since is not None, self._bar_shown
        self._bar_since, self._bar_shown = None, False
        if not text:
            return
        if redrawn:
            self.log(logging.INFO if shown else logging.DEBUG, text)
        elif not self._dvc_hint(text) and not self._warning(text):
            if f"Stage '{self.stage}' didn't change" in text:
                self.skipped = True
            self.log(logging.INFO, text)
            self.tail.append(text)

    def _dvc_hint(self, text: str) -> bool:
        line = text.strip()
        if line == DVC_TRACK_HINT:
            self._in_track_hint = True
            return True
        if self._in_track_hint and line.startswith("git add "):
            self._in_track_hint = False
            self.to_track += [f for f in shlex.split(line)[2:] if f not in self.to_track]
            return True
        return line in DVC_HINT_LINES

    def _warning(self, text: str) -> bool:
        if text.startswith("  ") and text.strip() == self._warning_source:
            self._warning_source = None
            return True
        found = WARNING_LINE.fullmatch(text)
        if found is None:
            return False
        path, line = Path(found["path"]), int(found["line"])
        # Python prints the source line when it can read it; the same file is read here.
        self._warning_source = linecache.getline(str(path), line).strip() or None
        if path.is_absolute() and path.is_relative_to(self.repo_dir):
            path = path.relative_to(self.repo_dir)
        message = f"{found['category']}: {found['text']} ({path}:{line})"
        self.log(logging.WARNING, message)
        self.tail.append(message)
        return True


class CommandTimedOut(RuntimeError):
    """A command ran past its deadline; its whole process tree was stopped."""

    def __init__(self, seconds: float):
        super().__init__(f"ran longer than {seconds:g} s and was stopped")
        self.seconds = seconds


# After SIGTERM, how long the processes get to stop (DVC releases its lock, a trainer finishes
# writing a file) before SIGKILL.
STOP_GRACE_S = 10.0


def stop_process_tree(pid: int, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process ``pid`` and every process under it, then SIGKILL to those left
    after ``grace`` seconds.

    The whole tree, because `dvc repro` runs the stage's command in a child of its own: stopping
    DVC alone would leave a training run going, holding its checkpoint lock.
    """
    import psutil  # here: this module is imported before a run's server starts (early start)

    # Frozen first, parents before their children, so that none can start a process between
    # the listing and the signal: it would be left running.
    processes: list[psutil.Process] = []
    try:
        pending = [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    while pending:
        process = pending.pop()
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
            processes.append(process)
            pending += [p for p in process.children() if p not in processes]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
            process.resume()  # a stopped process acts on SIGTERM once it runs again
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace)


class Deadline:
    """Stops ``process`` and everything under it once ``timeout`` seconds (> 0) have passed
    (never without a timeout)."""

    def __init__(self, process: subprocess.Popen, timeout: float | None):
        self.process = process
        self.timeout = timeout or 0
        self.passed = threading.Event()
        self._timer = threading.Timer(self.timeout, self._stop)
        self._timer.daemon = True
        if timeout:
            self._timer.start()

    def _stop(self) -> None:
        self.passed.set()
        stop_process_tree(self.process.pid)

    def stopped(self) -> bool:
        """The deadline passed and the process is gone (its output may still be held open)."""
        return self.passed.is_set() and self.process.poll() is not None

    def cancel(self) -> None:
        self._timer.cancel()

    def check(self) -> None:
        """Raise :class:`CommandTimedOut` when the deadline passed, once its stopping is done:
        the output can end (the first process gone) while it still stops the rest."""
        if self.passed.is_set():
            self._timer.join()
            raise CommandTimedOut(self.timeout)
