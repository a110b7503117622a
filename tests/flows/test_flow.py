"""The Prefect flow end to end under a test harness, and bad data stopping it."""

from __future__ import annotations

import json

import pytest

from tests.flows.conftest import environment, read_json


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


@pytest.mark.slow
def test_retrain_flow_runs_every_stage_and_publishes_artifacts(
    tiny_project, prefect_harness, monkeypatch
):
    from prefect.client.orchestration import get_client

    from flows.pipeline import retrain

    monkeypatch.setenv("PATH", environment()["PATH"])
    outputs = retrain(repo_dir=str(tiny_project))
    assert outputs["stages"] == {
        stage: "ran" for stage in ("prepare", "base", "validate", "train", "evaluate", "promote")
    }
    assert outputs["decision"] == "promoted"
    assert (tiny_project / "reports" / "eval" / "report.md").is_file()

    async def artifact_keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    import asyncio

    assert {"evaluation-report", "evaluation-metrics"} <= asyncio.run(artifact_keys())

    # Scheduled retraining: new raw data, start from production, promote or reject.
    raw = tiny_project / "data" / "raw" / "more.jsonl"
    raw.write_text(
        "".join(json.dumps({"prompt": f"The sequel number {i} was"}) + "\n" for i in range(30))
    )
    again = retrain(repo_dir=str(tiny_project), from_production=True)
    assert again["stages"]["prepare"] == "ran" and again["stages"]["train"] == "ran"
    params = (tiny_project / "params.yaml").read_text()
    assert "source: models/production/v0001" in params
    registry = read_json(tiny_project / "models" / "registry.json")
    assert len(registry["entries"]) == 2


@pytest.mark.slow
def test_bad_data_stops_the_flow_at_validation(tiny_project, prefect_harness, monkeypatch):
    from flows.pipeline import StageFailed, retrain

    monkeypatch.setenv("PATH", environment()["PATH"])
    first = retrain(repo_dir=str(tiny_project))
    prepared = tiny_project / "data" / "prepared"
    before = {p.name: p.read_bytes() for p in prepared.iterdir()}
    production = (
        tiny_project / "models" / "production" / "v0001" / "model.safetensors"
    ).read_bytes()
    registry = (tiny_project / "models" / "registry.json").read_text()
    assert first["decision"] == "promoted"

    long_prompt = " ".join(["great"] * 60)
    (tiny_project / "data" / "raw" / "bad.jsonl").write_text(
        json.dumps({"prompt": long_prompt}) + "\n"
    )
    with pytest.raises(StageFailed, match="validate"):
        retrain(repo_dir=str(tiny_project))
    report = tiny_project / "reports" / "validation"
    summary = read_json(report / "summary.json")
    assert summary["success"] is False
    assert (report / "data_docs" / "index.html").is_file()
    assert {p.name: p.read_bytes() for p in prepared.iterdir()} == before
    assert (
        tiny_project / "models" / "production" / "v0001" / "model.safetensors"
    ).read_bytes() == production
    assert (tiny_project / "models" / "registry.json").read_text() == registry


@pytest.mark.slow  # starts a Prefect test server (about 27 s)
def test_a_second_retraining_run_refuses_while_one_runs(tmp_path, prefect_harness):
    from flows.pipeline import retrain
    from ppo_core.files import RunLockedError, exclusive_run

    holder = exclusive_run(tmp_path / ".retrain.lock", "retraining run")  # e.g. the schedule's
    refused = pytest.raises(RunLockedError, match="another retraining run in this repository")
    with holder, refused:
        retrain(repo_dir=str(tmp_path))
