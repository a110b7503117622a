"""The Prefect server of `python -m flows.pipeline run` when none is named.

A run needs a Prefect API. Where neither the environment nor the active Prefect profile names
one (``PREFECT_API_URL``), the run starts ``prefect server start`` on a free loopback port,
without the UI or the background services (scheduler, automations: nothing outlives the run),
and stops it when the run ends. This is what Prefect's own temporary server does, with one
difference that matters on a short run: the server is started first, before this process
imports Prefect and the flow, so that the two processes import at the same time instead of one
after the other (about 4 s of a default run; docs/benchmarks.md, "Orchestration overhead").

This module imports nothing heavy, so that it can run before those imports.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from prefect.settings import Setting

# A first start on a busy two-core machine creates the database and takes about 40 s; the wait
# is bounded well above that. PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS overrides it, as
# it does for Prefect's own temporary server.
STARTUP_TIMEOUT_S = 120.0
TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# Lines of the server's output quoted when it fails to start.
TAIL_LINES = 20


class LocalServerError(RuntimeError):
    """The run's own Prefect server did not come up; the message quotes its output."""


def api_url_named() -> bool:
    """Whether ``PREFECT_API_URL`` is set, in the environment or the active Prefect profile.

    The environment is read first: it is free, while reading the profile imports Prefect's
    settings (about 0.6 s)."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalServer:
    """``prefect server start`` on ``127.0.0.1`` and a free port, started at construction.

    Call :meth:`wait_until_up` before the first API call; the server stops when this process
    exits, or at :meth:`stop`."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.log = Path(tempfile.mkstemp(prefix="ppo-prefect-server-", suffix=".log")[1])
        prefect = Path(sys.executable).parent / "prefect"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [
                    str(prefect),
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--no-services",
                    "--no-ui",
                    "--analytics-off",
                    "--log-level",
                    "WARNING",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        # Stopped when this process exits, after Prefect's workers have sent their last logs and
        # events (exit handlers run last-registered first, and theirs come later than this).
        atexit.register(self.stop)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def settings(self) -> dict[Setting | str, str | None]:
        """Prefect settings that point this process at the server (for
        ``prefect.settings.temporary_settings``): its API; no UI link, as it serves none; and no
        flow-run heartbeats. Heartbeats are for an automation that marks a run Crashed when they
        stop (``automations.yaml``), which a server started for one run has not got, and
        Prefect's heartbeat thread holds up the run's end for up to 1 s."""
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

        return {
            PREFECT_API_URL: self.api_url,
            PREFECT_UI_URL: "",
            "flows.heartbeat_frequency": None,
        }

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_until_up(self, timeout: float | None = None) -> None:
        """Return once the server answers ``/health``; raise :class:`LocalServerError` with the
        end of its output when it exits first or ``timeout`` seconds pass."""
        if timeout is None:
            timeout = float(os.environ.get(TIMEOUT_ENV) or STARTUP_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None:
                raise LocalServerError(
                    f"the local Prefect server exited with code {self.process.returncode} "
                    f"before it answered:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise LocalServerError(
                    f"the local Prefect server did not answer within {timeout:g} s ({TIMEOUT_ENV} "
                    f"sets the wait):\n{self.tail()}"
                )
            time.sleep(0.05)

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return "\n".join(lines) or "(no output)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its log."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.unlink(missing_ok=True)


def start_if_needed(argv: list[str]) -> LocalServer | None:
    """A :class:`LocalServer` for ``python -m flows.pipeline run ...`` when no API is named;
    ``None`` for anything else (``serve``, ``--help``, a named server)."""
    if not argv or argv[0] != "run" or "-h" in argv or "--help" in argv or api_url_named():
        return None
    return LocalServer()


def local_server_settings() -> AbstractContextManager[Any]:
    """Prefect settings for the temporary server that a run without a Prefect server starts,
    each only where neither the environment nor the active Prefect profile sets it.

    Telemetry off: its service writes a session row into the server's new SQLite database while
    the server sets itself up (a "database is locked" traceback when the two collide) and posts
    to Prefect (an error without a network); either reads as a failure when none happened.
    A longer start-up wait: on a busy two-core machine a first start, which creates the
    database, takes about 40 s, twice Prefect's default wait.
    """
    # Here, not at the top: this module runs before Prefect is imported (the early start).
    from prefect.settings import (
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    return temporary_settings(
        set_defaults={
            PREFECT_SERVER_ANALYTICS_ENABLED: False,
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120,
        }
    )
