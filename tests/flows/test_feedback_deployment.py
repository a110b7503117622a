"""The feedback loop in production, on a real local Prefect server with a `process` work pool
and its worker: `ppo ingest --feedback` starts 'retrain/on-new-feedback', whose run takes the
file, trains a reward model and PPO against `reward:current`; a second ingest's run trains a
second reward model, judges it against the first and trains PPO on the winner."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flows.orchestration.run_params import set_params
from ppo_core.base_sources.review_grammar import example_feedback
from tests.flows.conftest import BIN, git_commit, read_json
from tests.flows.servers import flow_runs, prefect, start_server, start_worker, stop, wait_for

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def feedback_runs(env: dict[str, str]) -> list[dict]:
    """The runs an event started (`new_data_only`: here those of 'retrain/on-new-feedback'),
    oldest first; the schedule's future runs aside."""
    runs = [r for r in flow_runs(env) if r.get("parameters", {}).get("new_data_only")]
    return sorted(runs, key=lambda r: r["created"])


def ingest_feedback(env: dict[str, str], project: Path, path: Path) -> None:
    done = subprocess.run(
        [str(BIN / "ppo"), "ingest", "--feedback", str(path)],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sent ppo.feedback.ingested" in done.stderr, done.stderr


@pytest.mark.slow
def test_feedback_ingests_retrain_the_reward_and_ppo_trains_on_the_winner(tiny_project, tmp_path):
    project = tiny_project
    set_params(
        str(project),
        {
            "model.reward": "reward:current",
            "validation.min_train_pairs": 16,
            "validation.min_eval_pairs": 4,
        },
    )
    git_commit(project, "PPO against the current reward version")
    env, logs, server = start_server(tmp_path, {"PREFECT_WORKER_QUERY_SECONDS": "2"})
    worker = None
    try:
        created = prefect(env, project, "work-pool", "create", "ppo", "--type", "process")
        assert created.returncode == 0, created.stdout + created.stderr
        deployed = prefect(env, project, "--no-prompt", "deploy", "--all")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        worker = start_worker(env, tmp_path, logs / "worker.log")

        def worker_log() -> str:
            return (logs / "worker.log").read_text()[-4000:]

        for number, (rows, name) in enumerate(
            [
                (example_feedback(120, seed=0), "first.jsonl"),
                (example_feedback(160, seed=1, ratings=True), "second.jsonl"),
            ],
            start=1,
        ):
            path = tmp_path / name
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            ingest_feedback(env, project, path)
            wait_for(
                lambda n=number: (
                    len(runs := feedback_runs(env)) >= n
                    and all(r["state_type"] in FINAL for r in runs)
                ),
                900,
                f"the run of feedback ingest {number} to end",
            )
            run = feedback_runs(env)[-1]
            assert run["state_type"] == "COMPLETED", worker_log()
            assert run["parameters"].get("new_data_only") is True
            assert (project / "data" / "feedback" / name).is_file()
        registry = read_json(project / "models" / "rewards" / "registry.json")
        first, second = registry["entries"]
        assert first["version"] == "r0001" and second["parent"] == "r0001"
        assert any("vs the current version's" in reason for reason in second["reasons"])
        winner = registry["current"]
        summary = read_json(project / "models" / "candidate" / "training_summary.json")
        assert summary["reward"] == f"reward:{winner}"
        assert read_json(project / "reports" / "reward" / "current.json")["current"] == winner
        production = read_json(project / "models" / "registry.json")
        assert production["entries"][-1]["reward"] == f"reward:{winner}"
    finally:
        if worker is not None:
            stop(worker)
        stop(server)
