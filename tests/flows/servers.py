"""A real Prefect server for the deployment, work-pool and worker-crash scenarios, and the
`prefect` commands they drive it with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
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


def migrated_database() -> Path:
    """A Prefect database with every migration of the installed Prefect applied, built once
    (``prefect server database upgrade``, about 10 s) in the temporary folder and shared by the
    test runs and their workers, which each start their server on a copy of it (a server
    starting on an empty database migrates it first: 10 s of its 14 here)."""
    import fcntl
    import shutil
    import tempfile

    import prefect

    folder = Path(tempfile.gettempdir()) / f"ppo-tests-prefect-{prefect.__version__}-{os.getuid()}"
    database = folder / "prefect.db"
    folder.mkdir(exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker migrates, the others wait for it
        if not database.is_file():
            building = Path(tempfile.mkdtemp(dir=folder))
            done = subprocess.run(
                [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
                env=environment() | {"PREFECT_HOME": str(building)},
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            os.replace(building / "prefect.db", database)  # whole or absent
            shutil.rmtree(building)
    return database


def migrated_home(home: Path) -> Path:
    """``home`` (made if missing) as a ``PREFECT_HOME`` holding a copy of
    :func:`migrated_database`, so that a server started there does not migrate first."""
    import shutil

    home.mkdir(exist_ok=True)
    shutil.copyfile(migrated_database(), home / "prefect.db")
    return home


def start_server(
    tmp_path: Path, settings: dict[str, str] | None = None
) -> tuple[dict[str, str], Path, subprocess.Popen]:
    """A Prefect server on a free loopback port, up and healthy, on a copy of
    :func:`migrated_database`: the environment that points at it (plus ``settings``), the folder
    of the logs, and its process (:func:`stop` it)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    home = migrated_home(tmp_path / "prefect-home")
    env = environment() | {
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(home),
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


def api(env: dict[str, str], route: str, body: dict | None = None):
    """The server's REST answer to ``route`` (a POST of ``body`` when given, else a GET), as
    JSON; None when there is nothing at that route (404).

    The scenarios poll the server through this instead of the `prefect` command: one `prefect`
    command costs about 2 s of a core to start, and a poll each second kept a core busy for as
    long as a scenario waited."""
    request = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/{route}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def flow_runs(env: dict[str, str], *state_types: str) -> list[dict]:
    """The server's latest 50 flow runs (of ``state_types`` when given: ``"RUNNING"``, ...),
    latest expected start first, as the REST API gives them (``id``, ``parameters``,
    ``created``, ``state_type``, ``state`` with its ``message``, ...). A schedule's future runs
    come first: pass the state types of the runs wanted."""
    body: dict = {"limit": 50, "sort": "EXPECTED_START_TIME_DESC"}
    if state_types:
        body["flow_runs"] = {"state": {"type": {"any_": list(state_types)}}}
    return api(env, "flow_runs/filter", body)


def state_message(env: dict[str, str], run: dict) -> str:
    """The message of ``run``'s current state, read afresh from the server."""
    return (api(env, f"flow_runs/{run['id']}")["state"] or {}).get("message") or ""


class WebhookReceiver:
    """A small HTTP server on 127.0.0.1 that records the JSON body of every POST it is sent
    (what a Prefect Custom Webhook notification block delivers), in a thread of its own."""

    def __init__(self):
        import http.server
        import threading

        received: list[dict] = []
        self.received = received
        self.headers: list[dict[str, str]] = []
        self.status = 200  # what it answers: set another to play a receiver that refuses
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length) or b"{}"))
                receiver.headers.append(dict(self.headers))
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args):  # no request lines on stderr
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def with_subject(self, text: str) -> list[dict]:
        return [message for message in self.received if text in message.get("subject", "")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def command(env, project, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def run_flow(env, project) -> subprocess.CompletedProcess:
    return command(env, project, sys.executable, "-m", "flows.pipeline", "run")


def notify(env, project, url, *more: str) -> None:
    """`ppo notify --webhook URL` (``url`` None: ``more`` gives it another way), checked to
    have created both automations."""
    given = ("--webhook", url) if url is not None else ()
    done = command(env, project, str(BIN / "ppo"), "notify", *given, *more)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "retrain-notify-rejected, retrain-notify-failed" in done.stderr


def start_worker(env, cwd, log) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "ppo"],
        env=env,
        cwd=cwd,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path
