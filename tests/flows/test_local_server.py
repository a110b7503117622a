"""The run's own Prefect server (flows/orchestration/local_server.py), and the orchestration process staying
free of the model stack (what lets it start in seconds)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

from flows.orchestration.local_server import LocalServer, LocalServerError, start_if_needed
from tests.flows.conftest import ROOT
from tests.flows.servers import migrated_home


def test_the_server_answers_on_loopback_and_is_gone_after_stop(tmp_path, monkeypatch):
    # a migrated database: tests/flows/test_flow.py starts one on an empty home, as `make run` does
    monkeypatch.setenv("PREFECT_HOME", str(migrated_home(tmp_path / "prefect-home")))
    server = LocalServer()
    try:
        server.wait_until_up()
        with urllib.request.urlopen(f"{server.api_url}/health", timeout=10) as answer:
            assert answer.status == 200
        assert server.api_url.startswith("http://127.0.0.1:")
        from prefect.settings import get_current_settings, temporary_settings

        with temporary_settings(updates=server.settings()):
            current = get_current_settings()
            assert str(current.api.url) == server.api_url
            # nothing watches a one-run server's heartbeats: none are sent
            assert current.flows.heartbeat_frequency is None
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert not server.log.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.api_url}/health", timeout=5)


def test_a_server_that_cannot_start_is_an_error_quoting_its_output(tmp_path, monkeypatch):
    # A database it cannot create: the server exits during its start-up.
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv(
        "PREFECT_API_DATABASE_CONNECTION_URL",
        f"sqlite+aiosqlite:///{tmp_path}/no/such/folder/prefect.db",
    )
    server = LocalServer()
    with pytest.raises(LocalServerError, match=r"exited with code \d+ before it answered:\n"):
        server.wait_until_up(timeout=120)
    server.stop()


def test_a_named_server_or_another_command_starts_none(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert start_if_needed(["run"]) is None
    monkeypatch.delenv("PREFECT_API_URL")
    assert start_if_needed(["serve"]) is None
    assert start_if_needed(["run", "--help"]) is None
    assert start_if_needed([]) is None


def test_the_flow_process_loads_and_checks_a_config_without_torch():
    script = (
        "import sys\n"
        "import flows.cli, flows.ingest, flows.pipeline, flows.orchestration.records, flows.stages\n"
        "from ppo_core.config import load_config\n"
        "from ppo_core.evaluation.markdown import escape_markdown\n"
        "from flows.orchestration.run_params import check_run_params\n"
        "load_config('params.yaml')\n"
        "check_run_params('.', {'ppo.epochs': 2})\n"
        "escape_markdown('a *b*')\n"
        "heavy = [m for m in ('torch', 'transformers', 'dvc') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
