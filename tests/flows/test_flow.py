"""The Prefect flow end to end under a test harness, and bad data stopping it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.speed import orchestration
from tests.flows.conftest import dvc, environment, experiment_scores, read_json
from tests.flows.servers import start_server, stop


@pytest.fixture(scope="module")
def prefect_harness(tmp_path_factory):
    """A Prefect server for the flows this process runs (on a migrated database: seconds)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env, _, server = start_server(tmp_path_factory.mktemp("prefect-server"))
    try:
        with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
            yield
            # the logs and events still queued reach the server before it stops
            APILogWorker.drain_all()
            EventsWorker.drain_all()
    finally:
        stop(server)


def run_like_make_run(project: Path, prefect_home: Path) -> str:
    """`python -m flows.pipeline run` in ``project`` on its own temporary Prefect server, as
    `make run` does for a new user (no Prefect settings); stdout and stderr as one text."""
    env = environment() | {"PREFECT_HOME": str(prefect_home)}
    for name in [n for n in env if n.startswith("PREFECT_") and n != "PREFECT_HOME"]:
        del env[name]
    done = subprocess.run(
        [sys.executable, "-m", "flows.pipeline", "run"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-5000:]
    return done.stdout


@pytest.mark.slow
def test_a_first_run_then_retraining_from_production_then_bad_data_stopping_at_validation(
    tiny_project, prefect_harness, monkeypatch, tmp_path
):
    from prefect.client.orchestration import get_client

    from flows.orchestration.project import PROJECT_ENV
    from flows.pipeline import StageFailed, retrain
    from ppo_core.files import tree_sha256

    # 1. A first run as `make run` starts it reads cleanly: nothing that reads as a failure (the
    # temporary server's telemetry), no progress bars, and DVC's advice to `git add dvc.lock`
    # once for the run, not once per stage.
    started = time.time()
    output = run_like_make_run(tiny_project, tmp_path / "prefect-home")
    took = time.time() - started
    assert "Traceback" not in output and "| ERROR" not in output, output
    # bench/speed/orchestration.py reads this log (its smoke run is make soak's): the phases of
    # the flow and the seconds of each stage that ran
    phases = orchestration.phases(output, started, took)
    assert all(seconds >= 0 for seconds in phases.values())
    assert set(phases) == {
        "before_the_flow",
        "stages",
        "experiment_record",
        "after_the_record",
    }, output
    assert set(orchestration.stage_seconds(output, started)) == {"train", "evaluate", "promote"}
    assert "Loading weights" not in output and "autostage" not in output, output
    assert output.count("git add") == 1, output
    assert "dvc.lock changed: `git add dvc.lock` records this run in git" in output
    promoted = tiny_project / "models" / "production" / "v0001"
    assert f"production: {promoted} (promoted as v0001 by this run)" in output
    decision = "promoted as v0001: models/production/v0001"
    assert f"Finished in state Completed('{decision}')" in output  # the run's final state
    assert f"decision:   {decision}" in output
    # The project's first three stages were run and committed when it was built.
    for stage in ("prepare", "base", "validate"):
        assert f"Stage '{stage}' didn't change, skipping" in output, output
    assert (tiny_project / "reports" / "eval" / "report.md").is_file()
    # The entry names the code that trained the version (the project's commit, no tracked file
    # changed but those the pipeline rewrites) and the hash of what was promoted.
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tiny_project, capture_output=True, text=True, check=True
    ).stdout.strip()
    (first,) = read_json(tiny_project / "models" / "registry.json")["entries"]
    assert first["code_version"] == {"commit": head, "dirty": False}
    assert first["content_sha256"] == tree_sha256(promoted)

    # 2. Scheduled retraining: new raw data, start from production, promote or reject.
    monkeypatch.setenv("PATH", environment()["PATH"])
    monkeypatch.setenv(PROJECT_ENV, str(tiny_project))
    raw = tiny_project / "data" / "raw" / "more.jsonl"
    raw.write_text(
        "".join(json.dumps({"prompt": f"The sequel number {i} was"}) + "\n" for i in range(30))
    )
    params_before = (tiny_project / "params.yaml").read_bytes()
    state = retrain(from_production=True, return_state=True)
    # The decision is the run's final message (the UI, `prefect flow-run inspect`) ...
    assert state.is_completed()
    assert state.message == "promoted as v0002: models/production/v0002"
    # ... and the outputs its result, as retrain() returns them.
    again = state.result()
    assert again["stages"]["prepare"] == "ran" and again["stages"]["train"] == "ran"
    assert again["decision"] == "promoted"
    assert again["production"] == str(tiny_project / "models" / "production" / "v0002")
    # It started from production, and params.yaml holds that only while the run lasts.
    imported = read_json(tiny_project / "models" / "base" / "imported_from.json")
    assert imported["source"] == "models/production/v0001", imported
    assert (tiny_project / "params.yaml").read_bytes() == params_before
    assert not (tiny_project / ".retrain-params.json").exists()
    registry = read_json(tiny_project / "models" / "registry.json")
    assert len(registry["entries"]) == 2

    async def artifact_keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    import asyncio

    assert {"evaluation-report", "evaluation-metrics"} <= asyncio.run(artifact_keys())
    # Each run is a DVC experiment with the metrics it reached (the record caches only the last
    # stage again: `dvc repro` cached the others as they ran).
    shown = dvc(tiny_project, "exp", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    scores = experiment_scores(shown.stdout)
    assert len(scores) == 2 and all(name.startswith("retrain-") for name in scores), scores
    assert all(score is not None for score in scores.values()), scores

    # 3. Bad data stops the flow at validation and changes nothing that was published.
    prepared = tiny_project / "data" / "prepared"
    before = {p.name: p.read_bytes() for p in prepared.rglob("*") if p.is_file()}
    production = (
        tiny_project / "models" / "production" / "v0002" / "model.safetensors"
    ).read_bytes()
    registry_text = (tiny_project / "models" / "registry.json").read_text()
    long_prompt = " ".join(["great"] * 60)
    (tiny_project / "data" / "raw" / "bad.jsonl").write_text(
        json.dumps({"prompt": long_prompt}) + "\n"
    )
    with pytest.raises(StageFailed, match="validate"):
        retrain()
    report = tiny_project / "reports" / "validation"
    summary = read_json(report / "summary.json")
    assert summary["success"] is False
    assert (report / "data_docs" / "index.html").is_file()
    assert {p.name: p.read_bytes() for p in prepared.rglob("*") if p.is_file()} == before
    assert (
        tiny_project / "models" / "production" / "v0002" / "model.safetensors"
    ).read_bytes() == production
    assert (tiny_project / "models" / "registry.json").read_text() == registry_text

    # 4. A file left in the inbox by hand that prepare refuses (chat rows among plain prompts)
    # fails the run at prepare and is set aside with the reason, so that the next run is not
    # stopped by it as well: it runs on the data as it was and completes.
    (tiny_project / "data" / "raw" / "bad.jsonl").unlink()
    inbox = tiny_project / "data" / "inbox"
    inbox.mkdir(exist_ok=True)
    (inbox / "chats.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "A film?"}]}) + "\n"
    )
    with pytest.raises(StageFailed, match="prepare") as failed:
        retrain()
    assert "chats.jsonl were set aside" in str(failed.value)
    assert not (tiny_project / "data" / "raw" / "chats.jsonl").exists()
    [set_aside] = (tiny_project / "data" / "rejected").iterdir()
    assert (set_aside / "chats.jsonl").is_file()
    state = retrain(return_state=True)
    assert state.is_completed(), state.message


@pytest.mark.slow  # starts a Prefect test server (about 27 s)
def test_a_second_retraining_run_waits_while_one_runs(tmp_path, prefect_harness, monkeypatch):
    import threading
    import time

    from flows.orchestration.project import PROJECT_ENV
    from flows.pipeline import retrain
    from ppo_core.config import ConfigError
    from ppo_core.files import exclusive_run

    held, seconds = threading.Event(), 3.0

    def hold() -> None:  # e.g. the schedule's run
        with exclusive_run(tmp_path / ".retrain.lock", "retraining run"):
            held.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    monkeypatch.setenv(PROJECT_ENV, str(tmp_path))
    start = time.monotonic()
    # Once it has the lock, the run fails on the empty folder (no params.yaml to read).
    with pytest.raises(ConfigError):
        retrain()
    holder.join()
    assert time.monotonic() - start >= seconds - 0.5
