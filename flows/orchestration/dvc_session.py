"""One DVC process for all the stages of a run.

Each ``dvc`` command is a Python process that imports DVC and opens the repository before it
does anything: about 0.8 s, six times a run, where the stages of the default pipeline take two
minutes in all (docs/benchmarks.md, "Orchestration overhead"). A :class:`DvcSession` starts one
process (``python -m flows.orchestration.dvc_session``) that imports DVC once and runs each command it is sent
through DVC's own command line entry, ``dvc.cli.main``: the same parsing, output, lock and exit
code as the ``dvc`` command, in a process that is already warm.

The stage's command, which DVC starts, writes to that process's output, so the output reaches
the relay (:class:`flows.orchestration.relay.StageRelay`) as the ``dvc`` command's did. A line holding only
:data:`DONE` and the exit code ends each command's output. A command past its deadline is
stopped with the whole process (:func:`flows.orchestration.relay.stop_process_tree`); the next command starts
a new one.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

from flows.orchestration.relay import Deadline, StageRelay, output_segments, stop_process_tree

# Ends the output of one command; the exit code follows. A record separator first, so that no
# line a stage prints can be read as it.
DONE = "\x1eppo-dvc-done"
# How long an idle session's process gets to end by itself once its input is closed.
CLOSE_WAIT_S = 5.0


class DvcSession:
    """Runs ``dvc`` commands in one process, started on first use, in ``repo_dir``.

    Commands run one at a time (:meth:`run`); :meth:`close` (or leaving the ``with`` block)
    ends the process.
    """

    def __init__(self, repo_dir: str, env: dict[str, str]):
        self.repo_dir = repo_dir
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process now (it imports DVC while the caller goes on)."""
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flows.orchestration.dvc_session"],
                cwd=self.repo_dir,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )

    def run(self, args: list[str], relay: StageRelay, timeout: float | None = None) -> int:
        """``dvc ARGS`` with its output fed to ``relay`` as it arrives; returns the exit code.

        With ``timeout`` (seconds, > 0), the process and everything under it is stopped when
        the command runs longer, and :class:`flows.orchestration.relay.CommandTimedOut` is raised.
        """
        self.start()
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        returncode: int | None = None
        deadline = Deadline(process, timeout)
        try:
            process.stdin.write((json.dumps(args) + "\n").encode())
            process.stdin.flush()
            for text, finished in output_segments(process.stdout, deadline.stopped):
                if finished and text.startswith(DONE):
                    returncode = int(text[len(DONE) :])
                    break
                relay.feed(text, finished)
        except BaseException:
            # Cancelled or interrupted: the stage's processes get the chance to stop cleanly,
            # and DVC to release its lock.
            self.close()
            raise
        finally:
            deadline.cancel()
        if deadline.passed.is_set():
            try:
                deadline.check()
            finally:
                self.close()
        if returncode is None:  # the process ended without finishing the command
            code = process.wait()
            self.process = None
            return code or 1
        return returncode

    def close(self) -> None:
        """End the process: at once when it waits for a command (its input ends), else
        stopped with everything it runs."""
        process, self.process = self.process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        try:
            process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            stop_process_tree(process.pid)
            process.wait()
        process.stdout.close()

    def __enter__(self) -> DvcSession:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# What DVC imports on its first `dvc repro` (about 0.6 s on two cores), imported as the process
# starts, before the first command comes; and what `dvc exp save` adds (the experiments' queue,
# dulwich's porcelain, pygit2: about 0.4 s), imported in the background once the first command
# is done (so that two threads never import the same modules at once) while the stages run.
# Only a head start: a module missing from another DVC version is imported when it is needed.
FIRST_MODULES = (
    "dvc.cli.parser",
    "dvc.repo",
    "dvc.repo.reproduce",
    "dvc.repo.index",
    "dvc.stage.cache",
    "scmrepo.git",
)
LATER_MODULES = (
    "dvc.repo.experiments.save",
    "dvc.repo.experiments.queue.workspace",
    "dvc.repo.experiments.queue.celery",
    "dvc.repo.experiments.executor.base",
    "dulwich.porcelain",
    "pygit2",
)


def _import_ahead(modules: tuple[str, ...]) -> None:
    for module in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


# Sessions started ahead of the run that takes them (:func:`start_ahead`), by project folder.
_AHEAD: dict[str, DvcSession] = {}


def start_ahead(repo_dir: str, env: dict[str, str]) -> None:
    """Start the process of the session that :func:`take` will give for ``repo_dir`` and
    ``env``, now, so that it imports DVC while this process imports Prefect (``python -m
    flows.pipeline run``: on two cores the two imports overlap). A session never taken ends
    with this process: its input closes."""
    session = DvcSession(repo_dir, env)
    session.start()
    _AHEAD[repo_dir] = session


def take(repo_dir: str, env: dict[str, str]) -> DvcSession:
    """A started session in ``repo_dir`` with ``env``: the one started ahead for them while its
    process still runs, else a new one."""
    ahead = _AHEAD.pop(repo_dir, None)
    if ahead is not None:
        if ahead.env == env and ahead.process is not None and ahead.process.poll() is None:
            return ahead
        ahead.close()
    session = DvcSession(repo_dir, env)
    session.start()
    return session


def run_folder(argv: list[str]) -> str | None:
    """The project folder of ``python -m flows.pipeline run [--repo DIR]`` (resolved), from its
    arguments before they are parsed; ``None`` for anything else."""
    if not argv or argv[0] != "run" or "-h" in argv or "--help" in argv:
        return None
    folder = "."
    for index, arg in enumerate(argv):
        if arg == "--repo" and index + 1 < len(argv):
            folder = argv[index + 1]
        elif arg.startswith("--repo="):
            folder = arg.removeprefix("--repo=")
    return str(Path(folder).resolve())


def serve() -> None:
    """The session's process: one JSON list of arguments a line on stdin, each run as
    ``dvc ARGS``; :data:`DONE` and the exit code after each."""
    from dvc.cli import main as dvc_main

    _import_ahead(FIRST_MODULES)
    later: threading.Thread | None = threading.Thread(
        target=_import_ahead, args=(LATER_MODULES,), daemon=True
    )
    for line in sys.stdin:
        args = json.loads(line)
        code = dvc_main(args)
        sys.stderr.flush()
        sys.stdout.write(f"\n{DONE}{code}\n")
        sys.stdout.flush()
        if later is not None:
            later.start()
            later = None


if __name__ == "__main__":
    serve()
