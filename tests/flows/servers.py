"""A real Prefect server for the deployment, work-pool and worker-crash scenarios, and the
`prefect` commands they drive it with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.flows.conftest import BIN, environment
from tests.helpers import free_port


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def start_server(
    tmp_path: Path, settings: dict[str, str] | None = None
) -> tuple[dict[str, str], Path, subprocess.Popen]:
    """A Prefect server on a free loopback port, up and healthy: the environment that points
    at it (plus ``settings``), the folder of the logs, and its process (:func:`stop` it)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = environment() | {
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **(settings or {}),
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=(logs / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: healthy(api), 120, "the Prefect server")
    except BaseException:
        stop(server)
        raise
    return env, logs, server


def prefect(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300):
    return subprocess.run(
        [str(BIN / "prefect"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def flow_runs(env: dict[str, str], cwd: Path) -> list[dict]:
    listing = prefect(env, cwd, "flow-run", "ls", "-o", "json", "--limit", "50")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    return json.loads(listing.stdout) if listing.stdout.strip().startswith("[") else []


def state_message(env: dict[str, str], cwd: Path, run: dict) -> str:
    inspect = prefect(env, cwd, "flow-run", "inspect", run["id"], "-o", "json")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    return json.loads(inspect.stdout)["state"]["message"] or ""
